"""The rollout controller's hand-over to the trainer thread, against a real inference server: a batch
taken ahead of the trainer is not trained until a ``take`` hands it over, and one no ``take`` asks
for goes back to the buffer — across the two threads, no prompt is lost or counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kuberl.api.spec import DatasetSource
from kuberl.data.datasets import Example, examples
from kuberl.inference.engine import TorchEngine
from kuberl.inference.server import build_app
from kuberl.local.processes import free_port
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.rollout.client import InferenceClient
from kuberl.rollout.controller import RolloutController
from kuberl.rollout.ledger import PromptLedger
from kuberl.rollout.staleness import StalenessManager
from kuberl.rollout.types import Group, Trajectory
from kuberl.weights.sync import to_safetensors

from .loopback import serve_in_thread

TOKEN = "test-token-0123456789"
GROUPS = 2  # per training step


@dataclass
class TwoSamples:
    """The workflow extension point at its simplest: two unrewarded samples of the prompt's text."""

    tok: Any

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        ids = [self.tok.bos_token_id, *self.tok(str(example.prompt), add_special_tokens=False).input_ids]
        outs = await client.generate(ids, 2, 3, 1.0, 1.0)
        return Group([Trajectory(ids, o.output_ids, o.logprobs, o.versions, 0.0, group_id) for o in outs])


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.01)


@dataclass
class FirstHeld(TwoSamples):
    """TwoSamples, but the first group's episode ends only once ``release`` is set: a long episode that
    many short ones overtake."""

    release: threading.Event

    async def run_episode(self, client: InferenceClient, example: Example, group_id: int) -> Group | None:
        group = await super().run_episode(client, example, group_id)
        while group_id == 0 and not self.release.is_set():
            await asyncio.sleep(0.01)
        return group


@contextlib.contextmanager
def started(eta: int, workflow: Callable[[Any], Any] = TwoSamples,
            drop_stale: bool = False) -> Iterator[tuple[RolloutController, Callable[[int], None]]]:
    """A controller over one real replica, episodes of ``workflow(tokenizer)`` from builtin:arithmetic, η =
    ``eta``; yields it and a function that serves a version (the episodes of version 0 start at once)."""
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    port = free_port()
    stop_inference = serve_in_thread(build_app(TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0),
                                               tok, TOKEN), port)
    ledger = PromptLedger.restore(None, examples(DatasetSource(path="builtin:arithmetic"), 0))
    manager = StalenessManager(batch_size=GROUPS, max_staleness=eta, max_concurrent=16)
    controller = RolloutController(InferenceClient([f"http://127.0.0.1:{port}"], TOKEN), workflow(tok), ledger,
                                   manager, drop_stale)
    weights = to_safetensors(model.state_dict())
    controller.start()

    def serve(version: int) -> None:
        controller.update_weights(weights, version).result(60)

    serve(0)
    try:
        yield controller, serve
    finally:
        controller.stop()
        stop_inference()


@pytest.fixture
def rollout(request: pytest.FixtureRequest) -> Iterator[tuple[RolloutController, Callable[[int], None]]]:
    """``started(η = request.param)``."""
    with started(request.param) as running:
        yield running


def take(controller: RolloutController, groups: int, version: int, ahead: bool = False,
         timeout: float = 60.0) -> list[Group] | None:
    """``controller.take`` from another thread, as the trainer's: a take that never returns fails."""
    taken: list[list[Group] | None] = []
    other = threading.Thread(target=lambda: taken.append(controller.take(groups, version, ahead)), daemon=True)
    other.start()
    other.join(timeout)
    assert taken, f"take({groups}, {version}) not answered within {timeout:.0f} s"
    return taken[0]


def prompts_of(batch: list[Group] | None) -> set[int]:
    assert batch is not None and len(batch) == GROUPS
    return {g.prompt for g in batch if g.prompt is not None}


def first_batch_then_one_ahead(controller: RolloutController) -> set[int]:
    """η = 2: once version 0's three batches are generated, the first is taken and the second taken
    ahead (one stays in the buffer); the first's prompts."""
    wait_until(lambda: len(controller.buffer) == 3 * GROUPS, "version 0's (η + 1) batches generated")
    first = prompts_of(take(controller, GROUPS, 0, ahead=True))
    wait_until(lambda: len(controller.buffer) == GROUPS, "the next batch taken ahead")
    return first


@pytest.mark.parametrize("rollout", [2], indirect=True)
def test_a_batch_taken_ahead_stays_pending_until_a_take_hands_it_over(rollout):
    controller, _ = rollout
    first = first_batch_then_one_ahead(controller)
    checkpoint = controller.prompt_state()  # what a checkpoint saved now would keep
    assert checkpoint is not None and checkpoint["trained"] == len(first)
    second = prompts_of(take(controller, GROUPS, 1))
    assert not first & second and second <= set(checkpoint["pending"])  # a resume there would re-issue them
    after = controller.prompt_state()
    assert after is not None and after["trained"] == len(first | second)
    assert not (first | second) & set(after["pending"])
    assert after["trained"] + len(after["pending"]) == after["cursor"]
    # what /progress shows, read without a round trip through the loop, counts the same
    assert controller.prompt_counts() == {key: after[key] for key in ("trained", "reissued", "skipped")}
    lengths = controller.lengths.report()  # two samples an episode: trained those handed over, generated more
    assert lengths["trained"]["n"] == 2 * len(first | second) and lengths["generated"]["n"] >= 3 * 2 * GROUPS
    assert lengths["dropped"]["n"] == 0 and lengths["ks_generated_trained"] is not None


@pytest.mark.parametrize("rollout", [2], indirect=True)
def test_a_batch_taken_ahead_for_another_take_goes_back_to_the_buffer_first(rollout):
    controller, _ = rollout
    first = first_batch_then_one_ahead(controller)
    again = prompts_of(take(controller, GROUPS, 0))  # not the version taken ahead: that batch goes back, first
    third = prompts_of(take(controller, GROUPS, 0, ahead=True))  # this take ahead waits for a version never served
    assert len(first | again | third) == 3 * GROUPS
    assert min(again) < min(third)  # the batch taken ahead came back to the front, in its order
    state = controller.prompt_state()
    assert state is not None and state["trained"] == 3 * GROUPS and len(controller.buffer) == 0


@pytest.mark.parametrize("rollout", [0], indirect=True)
def test_a_take_ahead_called_off_before_it_had_a_batch_takes_nothing(rollout):
    """η = 0: version 1's batch cannot exist before version 1 is served, so the take ahead is still
    waiting when a take for something else calls it off; what version 1 then generates is all there."""
    controller, serve = rollout
    prompts_of(take(controller, GROUPS, 0, ahead=True))
    taken: list[list[Group] | None] = []
    other = threading.Thread(target=lambda: taken.append(take(controller, 1, 1)))
    other.start()
    time.sleep(0.2)  # the take for one group has called the take ahead off; both wait for version 1
    serve(1)
    other.join(60)
    assert len(taken) == 1 and taken[0] is not None and len(taken[0]) == 1
    wait_until(lambda: len(controller.buffer) == GROUPS - 1, "version 1's other group in the buffer")
    state = controller.prompt_state()
    assert state is not None and state["trained"] == GROUPS + 1
    assert state["trained"] + len(state["pending"]) == state["cursor"]




@pytest.mark.parametrize("rollout", [2], indirect=True)
def test_an_evaluation_due_at_a_version_starts_once_every_replica_serves_it_and_measures_that_version(rollout):
    """The evaluation due after step 2 is started as the trainer starts pushing version 2: it waits for
    the replicas to serve it, so no token of it comes from version 0 or 1."""
    controller, serve = rollout
    prompts = [Example(f"{i}+1=", str(i + 1)) for i in range(4)]
    due = controller.start_evaluation(prompts, TwoSamples(char_tokenizer()), 2, step=2)
    serve(1)
    time.sleep(0.3)  # rollout goes on at version 1 meanwhile
    assert not due.done()
    serve(2)
    result = due.result(60)
    assert (result.step, result.version, result.version_span, result.prompts) == (2, 2, 1, 4)


@pytest.mark.parametrize("rollout", [2], indirect=True)
def test_an_evaluation_whose_version_never_arrives_starts_anyway_and_says_which_it_measured(rollout, monkeypatch,
                                                                                           caplog):
    """A version lost on the way (a hung replica) must not stall the evaluation — and with it the trainer,
    which holds its next update for it: after its wait it measures what the replicas serve, and says so."""
    import logging

    from kuberl.rollout import controller as controller_module

    monkeypatch.setattr(controller_module, "EVAL_VERSION_WAIT_SECONDS", 0.3)
    controller, serve = rollout
    serve(1)
    with caplog.at_level(logging.WARNING, logger="kuberl.rollout"):
        result = controller.start_evaluation([Example("1+1=", "2")], TwoSamples(char_tokenizer()), 2, step=2).result(60)
    assert (result.step, result.version, result.version_span) == (2, 1, 1)
    assert "version 2 did not arrive within" in caplog.text


@pytest.mark.parametrize("drop_stale", [False, True], ids=["train", "drop"])
def test_a_late_group_is_trained_first_with_its_staleness_counted_or_dropped_and_its_prompt_reissued(drop_stale):
    """η = 1: the first group's episode outlives three steps of short ones. lateGroups: train — it is
    trained at the first step after it arrives, 3 versions old, counted late; drop — it is dropped, its
    prompt handed out again, and nothing trained is staler than η."""
    release = threading.Event()
    with started(1, lambda tok: FirstHeld(tok, release), drop_stale) as (controller, serve):
        for version in range(3):
            batch = take(controller, GROUPS, version)
            assert 0 not in prompts_of(batch)
            serve(version + 1)
        release.set()
        wait_until(lambda: any(g.prompt == 0 for g in controller.buffer.items), "the long episode arrived")
        batch = take(controller, GROUPS, 3)
        assert batch is not None
        lags = [3 - g.oldest_version for g in batch]
        if drop_stale:
            assert 0 not in prompts_of(batch) and max(lags) <= 1
            assert (controller.buffer.dropped, controller.buffer.late) == (1, 0)
            serve(4)
            wait_until(lambda: controller.prompt_counts()["reissued"] == 1, "the dropped group's prompt out again")
            assert controller.lengths.report()["dropped"]["n"] == 2
        else:
            assert batch[0].prompt == 0 and lags[0] == 3 and max(lags[1:]) <= 1  # the oldest first
            assert (controller.buffer.dropped, controller.buffer.late) == (0, 1)
            assert controller.lengths.report()["dropped"]["n"] == 0
