"""Forming the p2p exchange group when a member never connects (a replica killed after it was asked to
join): the trainer gives the group up as soon as its pool client sees the member leave, instead of
waiting for the open's timeout (300 s) — real gloo over loopback, one trainer rank in this process."""

from __future__ import annotations

import time

import pytest

from kuberl.local.processes import free_port
from kuberl.weights.p2p import await_group, in_background
from kuberl.weights.transport import open_group

ABANDONED_OPEN_SECONDS = 8  # a given-up open's own timeout: it ends within the test, not in the interpreter's exit


@pytest.mark.slow
def test_a_group_whose_member_never_connects_is_given_up_once_the_member_left():
    port, started = free_port(), time.monotonic()
    opening = in_background(lambda: open_group("127.0.0.1", port, 0, 2, bind_host="127.0.0.1",
                                               timeout_s=ABANDONED_OPEN_SECONDS))
    group = await_group(opening, member_left=lambda: time.monotonic() - started > 1.0, poll=0.1)
    assert group is None and not opening.done()  # the open still waits for rank 1 — in the background
    assert opening.exception(timeout=60) is not None  # until its own timeout


@pytest.mark.slow
def test_the_next_group_opens_at_once_while_one_given_up_still_waits():
    """The abandoned open keeps waiting on its own store connection, not on one the next group needs."""
    port, started = free_port(), time.monotonic()
    opening = in_background(lambda: open_group("127.0.0.1", port, 0, 2, bind_host="127.0.0.1",
                                               timeout_s=ABANDONED_OPEN_SECONDS, generation=0))
    assert await_group(opening, member_left=lambda: time.monotonic() - started > 0.5, poll=0.1) is None
    reopening = in_background(lambda: open_group("127.0.0.1", port, 0, 1, bind_host="127.0.0.1", timeout_s=300,
                                                 generation=1))
    group = await_group(reopening, member_left=lambda: time.monotonic() - started > 20, poll=0.1)  # a bound
    assert group is not None and group.size() == 1 and not opening.done()  # not after the abandoned open's end
    assert opening.exception(timeout=60) is not None


def test_a_group_every_member_joins_is_returned_open():
    port = free_port()
    opening = in_background(lambda: open_group("127.0.0.1", port, 0, 1, bind_host="127.0.0.1", timeout_s=60))
    group = await_group(opening, member_left=lambda: False, poll=0.1)
    assert group is not None and group.size() == 1


def test_a_group_that_fails_to_open_is_given_up():
    def refused() -> object:
        raise RuntimeError("connect: connection refused")

    assert await_group(in_background(refused), member_left=lambda: False, poll=0.1) is None
