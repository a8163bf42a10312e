"""The episode extension point: one async method per episode.

``RolloutWorkflow.run_episode`` gets the inference client and one dataset example and returns a
``Group`` of rewarded trajectories (or None to skip the example). Multi-turn or tool-using agents
implement the same method: call ``client.generate`` as often as they need and return the tokens
they want trained on. ``RLVRWorkflow`` is the single-turn, verifiable-reward case.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..data.datasets import Example
from ..data.example import Prompt
from ..inference.contract import FINISH_STOP
from ..rewards.pool import Scorer
from .client import InferenceClient, tracer
from .types import Group, Trajectory


def without_eos(tokens: list[int], eos_id: int) -> list[int]:
    """``tokens`` without a final end-of-sequence token (the text a reward or a reader sees)."""
    return tokens[:-1] if tokens and tokens[-1] == eos_id else tokens


async def score(prompt: str, completion_ids: list[int] | None, example: Example, decode: Callable[[list[int]], str],
                eos_id: int, reward: Scorer) -> float:
    """One completion's reward: ``reward(prompt, completion, answer, **row)`` for a finished answer
    (its EOS dropped; ``prompt`` is the text the policy was prompted with), 0 when ``completion_ids``
    is None (the length limit cut it off, or it never finished)."""
    with tracer.start_as_current_span("score", attributes={"kuberl.finished": completion_ids is not None}) as span:
        value = 0.0 if completion_ids is None else await reward.score(
            prompt, decode(without_eos(completion_ids, eos_id)), example.answer, example.row)
        span.set_attribute("kuberl.reward", value)
        return value


class RolloutWorkflow(Protocol):
    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None: ...


@dataclass(frozen=True)
class WorkflowContext:
    """What a workflow named by ``spec.rollout.workflow`` ('package.module:Name') is built from:
    ``Name(context)`` returns a :class:`RolloutWorkflow`, used for training and evaluation alike (an
    evaluation's context has its own group size, token budget, temperature and reward).

    ``encode_prompt``/``prompt_text``: a dataset prompt as the policy reads it (token ids / text,
    through ``spec.model.chatTemplate``); ``encode_text``: any text (a user or tool turn) as ids;
    ``decode``: ids → text; ``eos_id``: the end-of-sequence id; ``reward``: ``spec.reward`` as a scorer
    (:func:`score` calls it); ``group_size``: trajectories to return per example (GRPO's G);
    ``max_new_tokens``: the episode's budget of generated tokens (all turns); ``temperature``/``top_p``:
    the sampling the trainer's log-probs assume; ``tools``/``max_turns``: ``spec.rollout``'s, for a
    workflow that offers tools. A trajectory's ``loss_mask`` marks which output tokens the policy wrote
    (trained) and which are context (a user or tool turn: 0)."""

    encode_prompt: Callable[[Prompt], list[int]]
    prompt_text: Callable[[Prompt], str]
    encode_text: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    reward: Scorer
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    tools: tuple[str, ...] = ()
    max_turns: int = 4


@dataclass
class RLVRWorkflow:
    """G samples of one prompt, each scored by ``reward(prompt, completion, answer, **row)``; the G
    rewards are computed concurrently, off the event loop (``kuberl.rewards.pool``). Built from a
    :class:`WorkflowContext`, as a user's workflow is."""

    context: WorkflowContext

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        c = self.context
        ids, text = c.encode_prompt(example.prompt), c.prompt_text(example.prompt)
        outs = await client.generate(ids, c.group_size, c.max_new_tokens, c.temperature, c.top_p)
        scores = (score(text, out.output_ids if out.finish_reason == FINISH_STOP else None, example, c.decode,
                        c.eos_id, c.reward) for out in outs)
        # one task per sample only where the scores run side by side (reward workers)
        rewards = await asyncio.gather(*scores) if c.reward.concurrent else [await s for s in scores]
        return Group([Trajectory(ids, out.output_ids, out.logprobs, out.versions, reward, group_id,
                                 out.finish_reason or FINISH_STOP, routes=out.routes)
                      for out, reward in zip(outs, rewards, strict=True)])
