"""Held-out evaluation (``spec.evaluation``): k episodes of each of a fixed set of prompts — the run's
own episode workflow (single-turn, or multi-turn with its tools), through the inference pool at the
current version, scored by its reward, never trained on.

It runs on the rollout loop next to rollout (``RolloutController.start_evaluation``): the one due after
step N starts once every replica serves version N, with every prompt at once, and the trainer holds its
next weight update until it is done (``kuberl.trainer.evaluations``), so every token it scores was
written by the policy of version N: ``version`` and ``newest_version`` say so (the oldest and newest
version of its tokens). Metrics: ``reward`` (mean over every sample), ``pass_at_k`` (share of prompts
with at least one sample rewarded > 0: the unbiased pass@k estimator with n = k), ``length`` (mean
tokens the policy wrote per episode).
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


@dataclass(frozen=True)
class EvalResult:
    step: int  # the training steps it was due after
    version: int  # the oldest policy version of its tokens
    newest_version: int
    reward: float
    pass_at_k: float
    k: int
    length: float
    prompts: int
    seconds: float

    @property
    def version_span(self) -> int:
        """How many policy versions wrote its tokens: newest − oldest + 1 (1: one policy, as due)."""
        return self.newest_version - self.version + 1

    def metrics(self) -> dict[str, float]:
        """``eval/*`` as the logs, TensorBoard and Prometheus name them."""
        return {"eval/reward": self.reward, f"eval/pass@{self.k}": self.pass_at_k, "eval/length": self.length,
                "eval/version": float(self.version), "eval/version_span": float(self.version_span),
                "eval/seconds": self.seconds}


def summarize(step: int, rewards: list[list[float]], lengths: list[int], versions: list[int], k: int,
              seconds: float) -> EvalResult:
    """``rewards[i]``: the k rewards of prompt i."""
    flat = [r for per_prompt in rewards for r in per_prompt]
    return EvalResult(
        step=step, version=min(versions, default=0), newest_version=max(versions, default=0),
        reward=sum(flat) / max(len(flat), 1),
        pass_at_k=sum(any(r > 0 for r in per_prompt) for per_prompt in rewards) / max(len(rewards), 1), k=k,
        length=sum(lengths) / max(len(lengths), 1), prompts=len(rewards), seconds=round(seconds, 3),
    )


async def evaluate(client: InferenceClient, examples: list[Example], workflow: RolloutWorkflow, k: int,
                   step: int, progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Every example as one group of k episodes of ``workflow`` (the run's own: single-turn or with
    tools), all at once, scored by its reward; lengths count the tokens the policy wrote (their
    versions: ``Trajectory.trained_versions``). ``progress(done, total)`` is called as each example's group
    finishes."""
    started, done = time.monotonic(), 0

    async def one(index: int, example: Example) -> Group | None:
        nonlocal done
        group = await workflow.run_episode(client, example, index)
        done += 1
        if progress is not None:
            progress(done, len(examples))
        return group

    tasks = [asyncio.create_task(one(index, example)) for index, example in enumerate(examples)]
    try:
        groups = await asyncio.gather(*tasks)
    finally:  # cancelled, or a group failed: none is left running
        for task in tasks:
            task.cancel()
    episodes = [t for g in groups if g is not None for t in g.trajectories]
    per_prompt = [[t.reward for t in g.trajectories] for g in groups if g is not None]
    versions = [v for t in episodes for v in (t.trained_versions or t.versions)]
    return summarize(step, per_prompt, [t.trained_tokens for t in episodes], versions, k, time.monotonic() - started)
