"""The episode extension point: one async method per episode.

``RolloutWorkflow.run_episode`` gets the inference client and one dataset example and returns a
``Group`` of rewarded trajectories (or None to skip the example). Multi-turn or tool-using agents
implement the same method: call ``client.generate`` as often as they need and return the tokens
they want trained on. ``RLVRWorkflow`` is the single-turn, verifiable-reward case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..data.datasets import Example
from ..inference.contract import FINISH_STOP, Generation
from .client import InferenceClient
from .types import Group, Trajectory


def without_eos(tokens: list[int], eos_id: int) -> list[int]:
    """``tokens`` without a final end-of-sequence token (the text a reward or a reader sees)."""
    return tokens[:-1] if tokens and tokens[-1] == eos_id else tokens


def score(out: Generation, example: Example, decode: Callable[[list[int]], str], eos_id: int,
          reward: Callable[[str, str, str], float]) -> float:
    """One generation's reward: ``reward(prompt, completion, answer)`` for a finished answer (its EOS
    dropped), 0 for one the length limit cut off."""
    if out.finish_reason != FINISH_STOP:
        return 0.0
    return float(reward(example.prompt, decode(without_eos(out.output_ids, eos_id)), example.answer))


class RolloutWorkflow(Protocol):
    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None: ...


@dataclass
class RLVRWorkflow:
    """G samples of one prompt, each scored by ``reward(prompt, completion, answer)``."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    reward: Callable[[str, str, str], float]
    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        ids = self.encode(example.prompt)
        outs = await client.generate(ids, self.group_size, self.max_new_tokens, self.temperature, self.top_p)
        return Group([Trajectory(ids, out.output_ids, out.logprobs, out.versions,
                                 score(out, example, self.decode, self.eos_id, self.reward), group_id,
                                 out.finish_reason or FINISH_STOP) for out in outs])
