"""A held-out evaluation during training shares the pool with rollout: it keeps at most one training
batch's samples in flight instead of all its prompts at once, and only one group while rollout has
no batch to spare."""

from __future__ import annotations

import asyncio

from kuberl.data.datasets import Example
from kuberl.rollout.evaluation import evaluate
from kuberl.rollout.types import Group, Trajectory
from kuberl.trainer.evaluations import evaluation_concurrency


class CountingWorkflow:
    """A user's workflow whose episodes take a while; it records how many run at once."""

    def __init__(self, k: int):
        self.k, self.running, self.most = k, 0, 0

    async def run_episode(self, client: object, example: Example, group_id: int) -> Group:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        reward = 1.0 if example.answer == "right" else 0.0
        return Group([Trajectory(prompt_ids=[1], output_ids=[2, 3], behav_logprobs=[-0.1, -0.2], reward=reward,
                                 versions=[0, 0]) for _ in range(self.k)])


def examples(n: int) -> list[Example]:
    return [Example(f"{i}?", "right" if i % 4 == 0 else "wrong") for i in range(n)]


async def test_an_evaluation_keeps_at_most_its_concurrency_in_flight_and_scores_every_prompt():
    workflow = CountingWorkflow(k=4)
    result = await evaluate(None, examples(20), workflow, 4, step=7, concurrency=3)  # type: ignore[arg-type]
    assert workflow.most == 3
    assert (result.prompts, result.step, result.reward, result.pass_at_k) == (20, 7, 0.25, 0.25)


async def test_without_a_concurrency_every_prompt_starts_at_once():
    workflow = CountingWorkflow(k=4)
    await evaluate(None, examples(20), workflow, 4, step=0)  # type: ignore[arg-type]
    assert workflow.most == 20


async def test_an_evaluation_narrows_to_one_group_while_rollout_needs_the_pool():
    """``widen`` false: one group at a time, and it still finishes; true again: up to the concurrency."""
    workflow, spare = CountingWorkflow(k=4), False
    started = asyncio.get_running_loop().time()

    def widen() -> bool:
        nonlocal spare
        spare = asyncio.get_running_loop().time() - started > 0.15  # rollout is behind for the first 0.15 s
        return spare

    result = await evaluate(None, examples(40), workflow, 4, step=3, concurrency=5,  # type: ignore[arg-type]
                            widen=widen)
    assert result.prompts == 40 and result.pass_at_k == 0.25
    assert workflow.most == 5 and spare  # it widened once rollout had capacity to spare
    narrow = CountingWorkflow(k=4)
    await evaluate(None, examples(12), narrow, 4, step=3, concurrency=5, widen=lambda: False)  # type: ignore[arg-type]
    assert narrow.most == 1


def test_the_concurrency_is_one_training_batch_of_samples():
    assert evaluation_concurrency(batch_size=128, samples_per_prompt=16) == 8  # the main example
    assert evaluation_concurrency(batch_size=128, samples_per_prompt=8) == 16
    assert evaluation_concurrency(batch_size=8, samples_per_prompt=16) == 1  # never none
