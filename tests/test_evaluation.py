"""A held-out evaluation during training: every prompt at once, its result says which policy versions
wrote it, and the schedule holds the next weight update until it is done, so that one policy writes
it; an evaluation due while one still runs is skipped, and said so."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future

from kuberl.data.datasets import Example
from kuberl.rollout.evaluation import EvalResult, evaluate
from kuberl.rollout.types import Group, Trajectory
from kuberl.trainer.evaluations import Evaluations, version_range


class CountingWorkflow:
    """A user's workflow whose episodes take a while; it records how many run at once."""

    def __init__(self, k: int, versions: tuple[int, int] = (0, 0)):
        self.k, self.versions, self.running, self.most = k, list(versions), 0, 0

    async def run_episode(self, client: object, example: Example, group_id: int) -> Group:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        reward = 1.0 if example.answer == "right" else 0.0
        return Group([Trajectory(prompt_ids=[1], output_ids=[2, 3], behav_logprobs=[-0.1, -0.2], reward=reward,
                                 versions=self.versions) for _ in range(self.k)])


def examples(n: int) -> list[Example]:
    return [Example(f"{i}?", "right" if i % 4 == 0 else "wrong") for i in range(n)]


async def test_every_prompt_starts_at_once_and_is_scored():
    workflow = CountingWorkflow(k=4)
    result = await evaluate(None, examples(20), workflow, 4, step=7)  # type: ignore[arg-type]
    assert workflow.most == 20
    assert (result.prompts, result.step, result.reward, result.pass_at_k) == (20, 7, 0.25, 0.25)
    assert (result.version, result.version_span) == (0, 1)


async def test_an_evaluation_written_by_two_versions_says_so():
    result = await evaluate(None, examples(4), CountingWorkflow(k=2, versions=(3, 4)), 2, step=3)  # type: ignore[arg-type]
    assert (result.version, result.newest_version, result.version_span) == (3, 4, 2)
    assert version_range(result) == "3–4" and result.metrics()["eval/version_span"] == 2.0


def finished(step: int, version: int | None = None) -> EvalResult:
    version = step if version is None else version
    return EvalResult(step=step, version=version, newest_version=version, reward=0.5, pass_at_k=0.5, k=2,
                      length=3.0, prompts=4, seconds=0.1)


class Starts:
    """What the schedule starts (the rollout's evaluations): each a future the test completes."""

    def __init__(self) -> None:
        self.started: dict[int, Future[EvalResult]] = {}

    def __call__(self, step: int) -> Future[EvalResult]:
        self.started[step] = Future()
        return self.started[step]


def test_the_next_weight_update_waits_for_the_running_evaluation_and_it_is_recorded_a_step_later():
    starts = Starts()
    schedule = Evaluations(every=5, start=starts, hold_seconds=30)
    for done in range(1, 5):
        schedule.maybe_start(done)
    assert list(starts.started) == []
    schedule.maybe_start(5)
    schedule.hold(5)  # the update of version 5 itself went out before: nothing to wait for
    threading.Timer(0.2, lambda: starts.started[5].set_result(finished(5))).start()
    began = time.monotonic()
    schedule.hold(6)
    assert time.monotonic() - began >= 0.15 and starts.started[5].done()
    assert schedule.finished(6) == [finished(5)] and schedule.reported_after == {5: 6}
    assert schedule.finished(7) == []


def test_a_hold_gives_up_after_its_time_and_an_evaluation_due_meanwhile_is_skipped_loudly(caplog):
    starts = Starts()
    schedule = Evaluations(every=2, start=starts, hold_seconds=0.1)
    schedule.maybe_start(2)
    with caplog.at_level(logging.WARNING, logger="kuberl.trainer"):
        schedule.hold(3)
        schedule.maybe_start(4)
    assert "weight version 3 goes out anyway" in caplog.text
    assert "the evaluation due after step 4 is skipped" in caplog.text and schedule.skipped == [4]
    assert list(starts.started) == [2]
    starts.started[2].set_result(finished(2, version=2))
    schedule.maybe_start(6)
    assert schedule.finished(6) == [finished(2)] and list(starts.started) == [2, 6]
    starts.started[6].set_result(finished(6))
    assert schedule.wait(1.0, steps_done=6) == [finished(6)] and schedule.reported_after == {2: 6, 6: 6}
