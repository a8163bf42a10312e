"""Every dataset prompt is trained exactly once: through stale drops, failed episodes and a crash
between checkpoints (kuberl.rollout.ledger, as the rollout controller drives it)."""

import itertools
import random
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.data.datasets import Example
from kuberl.rollout.buffer import RolloutBuffer
from kuberl.rollout.ledger import MAX_FAILURES, MAX_STALE_DROPS, PromptLedger
from kuberl.rollout.staleness import StalenessManager
from kuberl.rollout.types import Group, Trajectory


def stream() -> Iterator[Example]:
    """A deterministic stream whose n-th prompt says n (as a run's dataset stream is deterministic)."""
    for n in itertools.count():
        yield Example(prompt=f"p{n}", answer=str(n))


def group(index: int, version: int) -> Group:
    t = Trajectory([1], [2], [0.0], [version])
    return Group([t], prompt=index)


def dropping_buffer(manager: StalenessManager, ledger: PromptLedger) -> RolloutBuffer[Group]:
    """lateGroups: drop — a group staler than η gives its prompt back."""
    return RolloutBuffer(manager, drop_stale=True, on_drop=lambda g: ledger.give_back(g.prompt, stale=True))


def simulate(ops: list[int], seed: int, crash_every: int) -> tuple[Counter[int], PromptLedger, set[int]]:
    """A rollout loop in miniature: hand prompts out, finish them out of order, train batches of 4 at
    increasing versions (η = 1, so late ones are dropped), fail some episodes; every ``crash_every``
    steps save a checkpoint, and one step after each checkpoint crash (everything in memory is lost)
    and resume from it. Returns how often each prompt was trained, the final ledger, and the prompts
    still out (running or in the buffer)."""
    rng = random.Random(seed)
    trained: Counter[int] = Counter()
    saved: tuple[dict[str, object], Counter[int]] = ({"cursor": 0, "pending": []}, Counter())
    ledger = PromptLedger.restore(None, stream())
    manager = StalenessManager(4, 1, 12)
    buffer: RolloutBuffer[Group] = dropping_buffer(manager, ledger)
    running: list[tuple[int, int]] = []
    version = step = 0
    for op in ops:
        if op == 0 and manager.try_start():
            running.append((ledger.hand_out()[0], version))
        elif op == 1 and running:
            index, started = running.pop(rng.randrange(len(running)))
            ok = rng.random() > 0.1
            manager.finish(accepted=ok)
            if ok:
                buffer.put(group(index, started))
            else:
                ledger.give_back(index)
        elif op == 2:
            batch = buffer.take_batch(4, version)
            if batch is None:
                continue
            for g in batch:
                ledger.mark_trained(g.prompt)
                trained[g.prompt] += 1
            version = step = step + 1
            manager.set_version(version)
            if step % crash_every == 0:
                saved = (ledger.state(), trained.copy())
            elif step % crash_every == 1 and step > 1:  # crash: back to the checkpoint
                state, trained = saved[0], saved[1].copy()
                ledger = PromptLedger.restore(state, stream())
                version = step = step - 1
                manager = StalenessManager(4, 1, 12)
                manager.restore(version)
                buffer = dropping_buffer(manager, ledger)
                running = []
    return trained, ledger, {index for index, _ in running} | {g.prompt for g in buffer.items}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=50, max_size=600), st.integers(0, 10**6),
       st.integers(2, 5))
def test_no_prompt_is_trained_twice_or_skipped_across_stale_drops_failures_and_crashes(ops, seed, crash_every):
    trained, ledger, out = simulate(ops, seed, crash_every)
    assert max(trained.values(), default=1) == 1, "a prompt was trained twice"
    assert ledger.trained == len(trained) and not set(trained) & set(ledger.pending)
    # every prompt handed out so far was trained, is still pending, or was skipped after failing repeatedly
    assert len(trained) + len(ledger.pending) + ledger.skipped == ledger.cursor
    assert set(trained) | set(ledger.pending) <= set(range(ledger.cursor))
    assert set(ledger.pending) == out | set(ledger.to_reissue), "a pending prompt is neither out nor to be reissued"


def test_a_restart_hands_out_first_what_the_checkpoint_had_pending():
    ledger = PromptLedger.restore(None, stream())
    out = [ledger.hand_out()[0] for _ in range(6)]
    for index in (0, 2, 3):
        ledger.mark_trained(index)
    ledger.give_back(5, stale=True)
    state = ledger.state()
    assert state == {"cursor": 6, "pending": [1, 4, 5], "trained": 3, "reissued": 0, "skipped": 0}
    resumed = PromptLedger.restore(state, stream())
    assert [resumed.hand_out() for _ in range(4)] == [
        (1, Example("p1", "1")), (4, Example("p4", "4")), (5, Example("p5", "5")), (6, Example("p6", "6"))]
    assert out == list(range(6)) and resumed.reissued == 3


def test_a_prompt_that_keeps_failing_is_skipped_not_retried_forever():
    ledger = PromptLedger.restore(None, stream())
    for _ in range(MAX_FAILURES):
        index, _ = ledger.hand_out()
        assert index == 0
        ledger.give_back(index)
    assert ledger.skipped == 1 and ledger.pending == [] and ledger.hand_out()[0] == 1


def test_stale_drops_are_no_fault_of_the_prompt_and_skip_it_only_when_they_never_end():
    """A group that waited in the buffer while training moved on says nothing about its prompt: three
    stale drops (a failure's limit) and a failure beside them leave it pending; only ``MAX_STALE_DROPS``
    skip it. (An elastic run dropped one prompt's group three times by chance and lost it.)"""
    ledger = PromptLedger.restore(None, stream())
    for _ in range(MAX_FAILURES):
        assert ledger.hand_out()[0] == 0
        ledger.give_back(0, stale=True)
    assert ledger.hand_out()[0] == 0
    ledger.give_back(0)  # one failure too
    assert ledger.skipped == 0 and ledger.pending == [0]
    for _ in range(MAX_STALE_DROPS - MAX_FAILURES):
        assert ledger.hand_out()[0] == 0
        ledger.give_back(0, stale=True)
    assert ledger.skipped == 1 and ledger.pending == [] and ledger.hand_out()[0] == 1


def test_training_a_prompt_twice_is_refused():
    ledger = PromptLedger.restore(None, stream())
    index, _ = ledger.hand_out()
    ledger.mark_trained(index)
    with pytest.raises(KeyError, match="trained twice"):
        ledger.mark_trained(index)
