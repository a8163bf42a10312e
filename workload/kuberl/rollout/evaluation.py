"""Held-out evaluation (``spec.evaluation``): k samples of each of a fixed set of prompts, generated
by the inference pool at the current version, scored, never trained on.

It runs on the rollout loop next to training (``RolloutController.start_evaluation``), so training
does not wait for it; if a weight update lands while it runs, its tokens carry two versions, and
``version`` reports the oldest. Metrics: ``reward`` (mean over every sample), ``pass_at_k`` (share
of prompts with at least one sample rewarded > 0: the unbiased pass@k estimator with n = k),
``length`` (mean generated tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..data.datasets import Example
from .client import InferenceClient
from .workflow import score

Reward = Callable[[str, str, str], float]


@dataclass(frozen=True)
class EvalConfig:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    reward: Reward
    k: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0


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


async def evaluate(client: InferenceClient, examples: list[Example], config: EvalConfig, step: int) -> EvalResult:
    """Every example k times, scored with ``config.reward`` (0 for an answer cut off by the length)."""
    started = time.monotonic()

    async def one(example: Example) -> tuple[list[float], list[int], list[int]]:
        outs = await client.generate(config.encode(example.prompt), config.k, config.max_new_tokens,
                                     config.temperature, config.top_p)
        rewards = [score(out, example, config.decode, config.eos_id, config.reward) for out in outs]
        return rewards, [len(o.output_ids) for o in outs], [v for o in outs for v in o.versions[:1]]

    results = await asyncio.gather(*(one(e) for e in examples))
    return summarize(step, [r for r, _, _ in results], [n for _, ls, _ in results for n in ls],
                     [v for _, _, vs in results for v in vs], config.k, time.monotonic() - started)
