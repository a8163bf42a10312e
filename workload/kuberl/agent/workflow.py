"""Multi-turn, tool-using episodes: the policy writes, calls a tool, reads its answer, writes on.

One episode (``ToolWorkflow.run_episode`` runs G of them per prompt, as a GRPO group):

    prompt → [policy turn] → tool call? → [tool message: context] → [policy turn] → ... → final answer

A policy turn ends at end-of-sequence or right after its first complete tool call (the client cuts
the generation there: what it wrote beyond the call is discarded, so a turn is a prefix of what the
engine sampled and its log-probs stay exact). The tool message (``TOOL_MESSAGE``) is tokenised and
appended as context: loss mask 0, log-prob 0, the version of the policy token before it. The episode
ends at a turn without a tool call, after ``max_turns`` turns, or when the token budget is spent;
its reward is the reward function's verdict on the last turn's text. ``info["tool_calls"]`` counts
the calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..data.datasets import Example
from ..inference.contract import FINISH_LENGTH, FINISH_STOP, Generation
from ..rollout.client import InferenceClient
from ..rollout.types import Group, Trajectory
from ..rollout.workflow import WorkflowContext, score
from .tools import ToolCall, first_call_end, parse_tool_calls, run_tool

if TYPE_CHECKING:
    import torch

TOOL_MESSAGE = "={}="  # how a tool's answer reads to the model: "calc(37*12)" → "=444="
MAX_TOOL_MESSAGE_CHARS = 512


def prefix_reaching(ids: list[int], decode: Callable[[list[int]], str], chars: int) -> list[int]:
    """The shortest prefix of ``ids`` whose text is at least ``chars`` characters long (all of
    ``ids`` if none is): prefix texts only grow, so a binary search finds it."""
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(decode(ids[:mid])) >= chars:
            high = mid
        else:
            low = mid + 1
    return ids[:low]


def cut_turn(ids: list[int], decode: Callable[[list[int]], str], stops: Collection[str] = (),
             at_call: bool = True) -> tuple[list[int], bool]:
    """A turn's tokens: cut right after its first tool call (``at_call``) or before the first of
    ``stops``, whichever comes first — a prefix of the sample, so its log-probs stay exact. Returns
    (tokens, cut at a stop string)."""
    text = decode(ids)
    call_end = first_call_end(text) if at_call else None
    stop_at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if stop_at is not None and (call_end is None or stop_at < call_end):
        kept = prefix_reaching(ids, decode, stop_at) if stop_at > 0 else []
        if kept and len(decode(kept)) > stop_at:  # its last token reaches into the stop string
            kept = kept[:-1]
        return kept, True
    return (ids if call_end is None else prefix_reaching(ids, decode, call_end)), False


@dataclass
class Episode:
    """The tokens of one episode so far, with their log-probs, versions and loss mask."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    tool_calls: int = 0
    routes: torch.Tensor | None = None  # the last generation's MoE routes, from the episode's first position
    routed: int = 0  # output tokens up to which those routes hold (a cut turn's later ones are not ours)

    def policy(self, ids: list[int], logprobs: list[float], versions: list[int],
               routes: torch.Tensor | None = None) -> None:
        """The policy's turn; ``routes``: its generation's (the call's input was the episode so far)."""
        self.output_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [1] * len(ids)
        if routes is not None:
            self.routes, self.routed = routes, len(self.output_ids)

    def routes_of(self, prompt_ids: list[int]) -> torch.Tensor | None:
        """The trajectory's routes: the last generation's up to its last kept token, then −1 for what
        came after (:func:`kuberl.models.moe_routing.fitted` to the trajectory's positions)."""
        if self.routes is None:
            return None
        from ..models import moe_routing  # torch: only where a mixture of experts sent routes

        return moe_routing.fitted(self.routes[:len(prompt_ids) + self.routed],
                                  len(prompt_ids) + len(self.output_ids) - 1)

    def context(self, ids: list[int]) -> None:
        last = self.versions[-1] if self.versions else 0
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)
        self.mask += [0] * len(ids)


@dataclass
class ToolWorkflow:
    """Multi-turn episodes with ``context.tools`` (at most ``context.max_turns`` model turns): built from a
    :class:`~kuberl.rollout.workflow.WorkflowContext`, as a user's workflow is."""

    context: WorkflowContext

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        prompt = self.context.encode_prompt(example.prompt)
        episodes = await asyncio.gather(*(self._episode(client, prompt) for _ in range(self.context.group_size)))
        text = self.context.prompt_text(example.prompt)
        return Group(list(await asyncio.gather(*(self._trajectory(prompt, text, ep, final, example, group_id)
                                                 for ep, final in episodes))))

    async def _episode(self, client: InferenceClient, prompt: list[int]) -> tuple[Episode, Generation]:
        """(the episode, the generation of its last turn: finish "stop" = a final answer)."""
        episode, unfinished = Episode(), Generation(finish_reason=FINISH_LENGTH)
        c = self.context
        for turn in range(c.max_turns):
            budget = c.max_new_tokens - len(episode.output_ids)
            if budget <= 0:
                return episode, unfinished
            (gen,) = await client.generate(prompt + episode.output_ids, 1, budget, c.temperature, c.top_p)
            ids, _ = cut_turn(gen.output_ids, c.decode)
            episode.policy(ids, gen.logprobs[:len(ids)], gen.versions[:len(ids)], gen.routes)
            calls = parse_tool_calls(c.decode(ids))[:1]
            if not calls:
                return episode, gen  # a final answer (or the budget ran out)
            episode.tool_calls += 1
            if turn < c.max_turns - 1:  # a tool may take seconds (the python sandbox): off the event loop
                answer = await asyncio.to_thread(self._answer, calls[0])
                episode.context(c.encode_text(TOOL_MESSAGE.format(answer)))
        return episode, unfinished  # out of turns while still calling tools

    def _answer(self, call: ToolCall) -> str:
        if call.name not in self.context.tools and call.error is None:
            return f"error: tool {call.name[:40]!r} is not enabled; tools: {', '.join(self.context.tools)}"
        return run_tool(call)[:MAX_TOOL_MESSAGE_CHARS]

    async def _trajectory(self, prompt: list[int], text: str, ep: Episode, final: Generation, example: Example,
                          group_id: int) -> Trajectory:
        """The episode as a trajectory, rewarded on its last turn's text if it finished with an answer."""
        finished = final.finish_reason == FINISH_STOP and ep.mask[-1:] == [1]
        c = self.context
        reward = await score(text, self._final_turn(ep) if finished else None, example, c.decode, c.eos_id, c.reward)
        return Trajectory(prompt, ep.output_ids, ep.logprobs, ep.versions, reward, group_id,
                          final.finish_reason or FINISH_LENGTH, info={"tool_calls": str(ep.tool_calls)},
                          loss_mask=ep.mask, routes=ep.routes_of(prompt))

    @staticmethod
    def _final_turn(ep: Episode) -> list[int]:
        """The tokens of the last policy turn (after the last tool message)."""
        start = len(ep.mask)
        while start > 0 and ep.mask[start - 1] == 1:
            start -= 1
        return ep.output_ids[start:]
