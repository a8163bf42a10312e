"""Held-out evaluation (``spec.evaluation``): k episodes of each of a fixed set of prompts — the run's
own episode workflow (single-turn, or multi-turn with its tools), through the inference pool at the
current version, scored by its reward, never trained on.

It runs on the rollout loop next to training (``RolloutController.start_evaluation``), so training
does not wait for it; if a weight update lands while it runs, its tokens carry two versions, and
``version`` reports the oldest. Metrics: ``reward`` (mean over every sample), ``pass_at_k`` (share
of prompts with at least one sample rewarded > 0: the unbiased pass@k estimator with n = k),
``length`` (mean tokens the policy wrote per episode).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..data.datasets import Example
from .client import InferenceClient
from .types import Group
from .workflow import RolloutWorkflow

WIDEN_POLL_SECONDS = 0.05  # how often a narrowed evaluation asks whether it may widen again


@dataclass(frozen=True)
class EvalResult:
    step: int
    version: int
    reward: float
    pass_at_k: float
    k: int
    length: float
    prompts: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """``eval/*`` as the logs, TensorBoard and Prometheus name them."""
        return {"eval/reward": self.reward, f"eval/pass@{self.k}": self.pass_at_k, "eval/length": self.length,
                "eval/version": float(self.version), "eval/seconds": self.seconds}


def summarize(step: int, rewards: list[list[float]], lengths: list[int], versions: list[int], k: int,
              seconds: float) -> EvalResult:
    """``rewards[i]``: the k rewards of prompt i."""
    flat = [r for per_prompt in rewards for r in per_prompt]
    return EvalResult(
        step=step, version=min(versions, default=0), reward=sum(flat) / max(len(flat), 1),
        pass_at_k=sum(any(r > 0 for r in per_prompt) for per_prompt in rewards) / max(len(rewards), 1), k=k,
        length=sum(lengths) / max(len(lengths), 1), prompts=len(rewards), seconds=round(seconds, 3),
    )


async def evaluate(client: InferenceClient, examples: list[Example], workflow: RolloutWorkflow, k: int,
                   step: int, progress: Callable[[int, int], None] | None = None,
                   concurrency: int | None = None, widen: Callable[[], bool] | None = None) -> EvalResult:
    """Every example as one group of k episodes of ``workflow`` (the run's own: single-turn or with
    tools), scored by its reward; lengths count the tokens the policy wrote. ``progress(done, total)``
    is called as each example's group finishes. ``concurrency``: at most that many groups at once (None:
    all of them); with ``widen``, more than one only while ``widen()`` says so (checked every
    :data:`WIDEN_POLL_SECONDS` and as groups finish) — during training, so that rollout keeps the pool
    it needs: the evaluation always moves on, one group at a time, and takes more while the pool has
    capacity to spare."""
    started, done = time.monotonic(), 0
    limit = concurrency or len(examples) or 1

    async def one(index: int, example: Example) -> Group | None:
        nonlocal done
        group = await workflow.run_episode(client, example, index)
        done += 1
        if progress is not None:
            progress(done, len(examples))
        return group

    tasks: list[asyncio.Task[Group | None]] = []
    running: set[asyncio.Task[Group | None]] = set()
    try:
        for index, example in enumerate(examples):
            while running and (len(running) >= limit or (widen is not None and not widen())):
                _, running = await asyncio.wait(running, timeout=WIDEN_POLL_SECONDS,
                                                return_when=asyncio.FIRST_COMPLETED)
            tasks.append(asyncio.create_task(one(index, example)))
            running.add(tasks[-1])
        groups = await asyncio.gather(*tasks)
    finally:  # cancelled, or a group failed: none is left running
        for task in tasks:
            task.cancel()
    trajectories = [g.trajectories for g in groups if g is not None]
    return summarize(step, [[t.reward for t in ts] for ts in trajectories],
                     [t.trained_tokens for ts in trajectories for t in ts],
                     [t.oldest_version for ts in trajectories for t in ts], k, time.monotonic() - started)
