"""A long-tailed episode for ``benchmarks/long_tail.py``: the run's own single-turn episode, then a "tool"
whose latency is log-normal (median :data:`MEDIAN_SECONDS`, σ = :data:`SIGMA` in log space) and whose
output — loss-masked context, as a tool's answer is — grows with that latency (a slow tool returns more),
so that an episode's length tells how long it took. Named in a manifest as
``spec.rollout.workflow: long_tail_episodes:LongTailEpisodes`` with this directory on ``PYTHONPATH``."""

from __future__ import annotations

import asyncio
import os
import random

from kuberl.data.datasets import Example
from kuberl.rollout.client import InferenceClient
from kuberl.rollout.types import Group, Trajectory
from kuberl.rollout.workflow import RLVRWorkflow, WorkflowContext

MEDIAN_SECONDS = float(os.environ.get("LONG_TAIL_MEDIAN_SECONDS", "0.05"))
SIGMA = float(os.environ.get("LONG_TAIL_SIGMA", "1.5"))
TOKENS_PER_MEDIAN = 4  # tool-output tokens per median latency
MAX_TOOL_TOKENS = 48


def tool_tokens(seconds: float) -> int:
    """How many tokens the tool returns after ``seconds``: proportional, at least 1, at most a cap."""
    return max(1, min(MAX_TOOL_TOKENS, round(TOKENS_PER_MEDIAN * seconds / MEDIAN_SECONDS)))


class LongTailEpisodes:
    def __init__(self, context: WorkflowContext):
        self.context = context
        self.inner = RLVRWorkflow(context)
        self.rng = random.Random(os.getpid())

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        group = await self.inner.run_episode(client, example, group_id)
        if group is None:
            return None
        seconds = self.rng.lognormvariate(0.0, SIGMA) * MEDIAN_SECONDS
        await asyncio.sleep(seconds)
        filler = self.context.encode_text(".")[:1] * tool_tokens(seconds)
        return Group([Trajectory(t.prompt_ids, t.output_ids + filler, t.behav_logprobs + [0.0] * len(filler),
                                 t.versions + [t.versions[-1] if t.versions else 0] * len(filler), t.reward, t.group,
                                 t.finish_reason, loss_mask=[*t.trained, *[0] * len(filler)])
                      for t in group.trajectories])
