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
from .client import InferenceClient
from .types import Group, Trajectory


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
        trajs = []
        for out in outs:
            tokens = out["output_ids"]
            text_ids = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
            completion = self.decode(text_ids)
            reward = float(self.reward(example.prompt, completion, example.answer)) if out["finish_reason"] == "stop" \
                else 0.0
            trajs.append(Trajectory(ids, tokens, out["logprobs"], out["versions"], reward, group_id,
                                    out["finish_reason"]))
        return Group(trajs)
