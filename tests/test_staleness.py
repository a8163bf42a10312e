"""Admission bounds staleness by η for episodes trained in turn; a late one (finished out of order) is
trained with its importance weights (counted) or, with lateGroups: drop, dropped; η = 0 is synchronous."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.rollout.buffer import RolloutBuffer
from kuberl.rollout.staleness import StalenessManager


@dataclass
class Sample:
    oldest_version: int


def simulate(batch: int, eta: int, concurrent: int, steps: int, seed: int, fifo: bool, drop_stale: bool = True):
    """Random asynchronous run: rollouts start when admitted, finish in random (or FIFO) order,
    the trainer takes a batch whenever one is ready. Returns (staleness of every trained sample,
    max running seen, buffer)."""
    rng = random.Random(seed)
    manager = StalenessManager(batch, eta, concurrent)
    buffer: RolloutBuffer[Sample] = RolloutBuffer(manager, drop_stale)
    running: list[int] = []  # start versions
    trained: list[int] = []
    max_running = 0
    for _ in range(20000):
        if manager.version >= steps:
            break
        action = rng.random()
        if action < 0.5 and manager.try_start():
            running.append(manager.version)
        elif action < 0.9 and running:
            start = running.pop(0 if fifo else rng.randrange(len(running)))
            manager.finish(accepted=True)
            buffer.put(Sample(start))
        else:
            got = buffer.take_batch(batch, manager.version)
            if got is not None:
                trained += [manager.version - s.oldest_version for s in got]
                manager.set_version(manager.version + 1)
        max_running = max(max_running, manager.running)
        assert manager.accepted + manager.running <= (eta + manager.version + 1) * batch
    return trained, max_running, buffer


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 8), eta=st.integers(0, 4), concurrent=st.integers(1, 64),
       seed=st.integers(0, 10**6), fifo=st.booleans())
def test_no_trained_sample_is_staler_than_eta(batch, eta, concurrent, seed, fifo):
    trained, max_running, buffer = simulate(batch, eta, concurrent, steps=12, seed=seed, fifo=fifo)
    assert all(0 <= s <= eta for s in trained)
    assert max_running <= concurrent
    if fifo:
        assert buffer.dropped == 0  # in-order completion never needs the safety net


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 8), eta=st.integers(0, 4), concurrent=st.integers(1, 64),
       seed=st.integers(0, 10**6), fifo=st.booleans())
def test_late_samples_are_trained_and_counted_not_dropped(batch, eta, concurrent, seed, fifo):
    """lateGroups: train — nothing is dropped; a sample staler than η is one that finished out of order,
    counted as late; in-order completion has none."""
    trained, _, buffer = simulate(batch, eta, concurrent, steps=12, seed=seed, fifo=fifo, drop_stale=False)
    assert buffer.dropped == 0 and len(trained) == 12 * batch
    assert buffer.late == sum(1 for s in trained if s > eta)
    if fifo:
        assert buffer.late == 0 and all(0 <= s <= eta for s in trained)


def test_batches_take_the_oldest_first_so_a_late_sample_waits_no_longer():
    manager = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8, version=3)
    buffer: RolloutBuffer[Sample] = RolloutBuffer(manager)
    manager.running = 3
    for version in (3, 1, 3):  # the one started at version 1 arrives second, two steps late
        manager.finish(accepted=True)
        buffer.put(Sample(version))
    assert [s.oldest_version for s in buffer.take_batch(2, 3) or []] == [1, 3]
    assert buffer.late == 1 and [s.oldest_version for s in buffer.items] == [3]


@pytest.mark.parametrize("seed", range(5))
def test_eta_zero_is_synchronous(seed):
    trained, max_running, _ = simulate(batch=4, eta=0, concurrent=64, steps=10, seed=seed, fifo=False)
    assert set(trained) == {0}
    assert max_running <= 4


def test_admission_formula_by_hand():
    m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=6)
    assert m.capacity == 6  # min((1+0+1)·4 − 0, 6)
    assert all(m.try_start() for _ in range(6)) and not m.try_start()
    for _ in range(6):
        m.finish(accepted=True)
    assert m.capacity == 2  # (1+0+1)·4 − 6 accepted
    m.set_version(1)
    assert m.capacity == 6  # min(12 − 6, 6)


def test_the_staleness_budget_in_use_by_hand():
    """(accepted + running − v·B) ÷ ((η + 1)·B): what an autoscaler reads (1: admission waits)."""
    m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=8)
    assert m.budget_used == 0.0
    assert all(m.try_start() for _ in range(3))
    assert m.budget_used == 3 / 8
    for _ in range(3):
        m.finish(accepted=True)
    assert all(m.try_start() for _ in range(5)) and not m.try_start()
    assert m.budget_used == 1.0  # 3 accepted + 5 running fill (1 + 1)·4: admission waits
    m.set_version(1)
    assert m.budget_used == (8 - 4) / 8  # the trainer took a batch: half the window is free again
    m.restore(3)
    assert m.budget_used == 0.0


def test_restore_restarts_accepted_at_version_times_batch():
    m = StalenessManager(batch_size=8, max_staleness=2, max_concurrent=100, version=5)
    assert m.accepted == 40 and m.capacity == 24
    m.try_start()
    m.restore(7)
    assert (m.accepted, m.running, m.capacity) == (56, 0, 24)


def test_bad_settings_and_misuse():
    with pytest.raises(ValueError):
        StalenessManager(batch_size=0, max_staleness=0, max_concurrent=1)
    m = StalenessManager(batch_size=1, max_staleness=0, max_concurrent=1)
    with pytest.raises(RuntimeError):
        m.finish(accepted=True)
    with pytest.raises(ValueError):
        m.set_version(-1)
