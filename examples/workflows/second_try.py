"""A user's episode logic, plugged in with ``spec.rollout.workflow: second_try:SecondTry`` (this
directory on ``PYTHONPATH``, or the module in the run's image): KubeRL builds ``SecondTry(context)``
(a :class:`kuberl.rollout.workflow.WorkflowContext`) and calls ``run_episode`` for every example.

Each episode has two turns: the policy answers, is told "again:", and answers once more; the user turn
is context (loss mask 0), both answers are trained on. The reward is the workflow's own: the dataset's
reward (``spec.reward``, through ``context.reward``) of the second answer, plus ``CONSISTENT`` when the
two answers agree — so a policy learns to be right and to stand by its answer."""

from __future__ import annotations

import asyncio

from kuberl.data.datasets import Example
from kuberl.rollout.client import InferenceClient
from kuberl.rollout.types import Group, Trajectory
from kuberl.rollout.workflow import WorkflowContext, score, without_eos

AGAIN = " again:"
CONSISTENT = 0.25


class SecondTry:
    def __init__(self, context: WorkflowContext):
        self.context = context

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        prompt = self.context.encode_prompt(example.prompt)
        episodes = [self._episode(client, example, prompt, group_id) for _ in range(self.context.group_size)]
        return Group(list(await asyncio.gather(*episodes)))

    async def _episode(self, client: InferenceClient, example: Example, prompt: list[int],
                       group_id: int) -> Trajectory:
        c = self.context
        turn = c.max_new_tokens // 2
        (first,) = await client.generate(prompt, 1, turn, c.temperature, c.top_p)
        again = c.encode_text(AGAIN)
        (second,) = await client.generate(prompt + first.output_ids + again, 1, turn, c.temperature, c.top_p)
        answers = [c.decode(without_eos(g.output_ids, c.eos_id)) for g in (first, second)]
        right = await score(c.prompt_text(example.prompt), second.output_ids if second.finish_reason == "stop"
                            else None, example, c.decode, c.eos_id, c.reward)
        last_version = first.versions[-1] if first.versions else 0
        return Trajectory(
            prompt, first.output_ids + again + second.output_ids,
            first.logprobs + [0.0] * len(again) + second.logprobs,
            first.versions + [last_version] * len(again) + second.versions,
            reward=right + CONSISTENT * (answers[0] == answers[1]), group=group_id,
            finish_reason=second.finish_reason or "stop",
            loss_mask=[1] * len(first.output_ids) + [0] * len(again) + [1] * len(second.output_ids))
