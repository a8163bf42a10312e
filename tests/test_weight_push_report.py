"""Each weight exchange's account (``kuberl.api.progress.WeightPush``): what it says of a pool's receipt, how the
run counts them (``kuberl.trainer.pushes``), how they reach the trainer's termination message whatever its size,
and the Events the operator posts when a push fell back or had a slow replica (``push_events``). The sync modes
produce them in the runs of tests/test_local_run.py (disk, p2p with a hung replica, LoRA) and tests/test_curves.py."""

from __future__ import annotations

import json

import pytest

from kuberl.api.progress import PoolReceipt, Progress, WeightPush
from kuberl.trainer.progress import TERMINATION_MESSAGE_BYTES, termination_message
from kuberl.trainer.pushes import PushTally
from kuberl_operator.progress import push_events


def test_a_push_account_names_its_slowest_replica_against_the_median():
    receipt = PoolReceipt(served={"http://a": 0.1, "http://b": 0.15, "http://c": 0.5}, lost={"http://d": "hung"})
    push = WeightPush.of(7, "p2p", 2_000_000, receipt)
    assert (push.version, push.mode, push.fell_back, push.replicas, push.replicas_lost) == (7, "p2p", False, 3, 1)
    assert push.seconds == 0.5 and push.gigabytes_per_second == 0.004  # 2 MB per replica in 0.5 s
    assert push.slowest_replica == "http://c" and push.slowest_ratio == 4.0 and push.slow_replica  # 0.5 ÷ 0.125
    even = WeightPush.of(8, "broadcast", 10, PoolReceipt(served={"http://a": 0.2, "http://b": 0.3}), "group broke")
    assert even.fell_back and even.reason == "group broke" and even.slowest_ratio == 1.5 and not even.slow_replica
    assert (push.transport, even.transport) == ("gloo over TCP", "HTTP")
    planned = WeightPush.of(7, "p2p", 2_000_000, receipt, planned_port_bytes=6_000_000)  # 3 copies through one port
    assert planned.port_gigabytes_per_second == 0.012 and push.port_gigabytes_per_second is None  # 6 MB in 0.5 s
    alone = WeightPush.of(9, "disk", 10, PoolReceipt(served={"http://a": 9.0}))
    assert alone.slowest_replica is None and alone.slowest_ratio is None  # nobody to compare it with


def test_a_push_nobody_took_has_no_rate_and_no_slowest():
    push = WeightPush.of(3, "broadcast", 100, PoolReceipt(lost={"http://a": "refused"}))
    assert push.replicas == 0 and push.seconds == 0 and push.gigabytes_per_second is None
    assert push.slowest_replica is None and push.slowest_ratio is None and not push.slow_replica


def test_the_run_counts_its_pushes_and_progress_carries_the_last():
    tally = PushTally()
    tally.add(None)  # a rank other than 0 accounts for nothing
    tally.add(WeightPush.of(1, "p2p", 10, PoolReceipt(served={"a": 0.1, "b": 0.1})))
    tally.add(WeightPush.of(2, "broadcast", 10, PoolReceipt(served={"a": 0.1, "b": 0.5}), "failed"))
    assert tally.by_mode == {"p2p": 1, "broadcast": 1} and tally.fell_back == 1 and tally.slow_replica == 1
    progress = Progress().merged(**tally.progress())
    wire = progress.to_wire()
    assert wire["pushesFellBack"] == 1 and wire["pushesSlowReplica"] == 1
    assert wire["lastPush"]["version"] == 2 and wire["lastPush"]["fellBack"] is True
    assert Progress.from_reply(wire) == progress  # what the operator reads back
    summary = tally.summary()
    assert summary["gigabytes_per_second_median"] is not None and summary["last"]["slowestReplica"] == "b"


@pytest.mark.parametrize("long_text", [10, 3000, 5000])
def test_the_termination_message_is_json_within_its_limit_whatever_the_progress_holds(long_text):
    push = WeightPush.of(9, "broadcast", 10, PoolReceipt(served={"r" * 200: 1.0}), "x" * 300)
    progress = Progress(step=9, reward=0.5, init_from="s3://" + "m" * min(long_text, 1000),
                        last_checkpoint="s3://" + "c" * min(long_text, 1000),
                        last_export="s3://" + "e" * min(long_text, 1000)).merged(last_push=push)
    wire = progress.to_wire()
    wire["modelRevision"] = "v" * long_text  # longer than the field allows: as a newer trainer might send
    text = termination_message(wire)
    assert len(text.encode()) <= TERMINATION_MESSAGE_BYTES
    kept = json.loads(text)
    assert kept["step"] == 9 and kept["reward"] == 0.5
    if long_text == 10:
        assert kept == wire  # nothing left out when it fits


def test_the_operator_posts_an_event_when_a_push_fell_back_or_had_a_slow_replica_since_the_last_poll():
    fell = WeightPush.of(12, "broadcast", 10, PoolReceipt(served={"http://r0": 0.1, "http://r1": 0.4}),
                         "p2p weight exchange failed (timeout)").to_wire()
    before = {"step": 11, "pushesFellBack": 1, "pushesSlowReplica": 0}
    after = {"step": 12, "pushesFellBack": 2, "pushesSlowReplica": 1, "lastPush": fell}
    events = dict(push_events(before, after))
    assert set(events) == {"WeightSyncFellBack", "WeightSyncSlowReplica"}
    assert events["WeightSyncFellBack"].startswith("1 weight exchange(s) fell back")
    assert "version 12 by broadcast" in events["WeightSyncFellBack"] and "timeout" in events["WeightSyncFellBack"]
    assert "http://r1 at 4.0×" in events["WeightSyncSlowReplica"]
    assert push_events(after, {**after, "step": 13}) == []  # nothing new: no Event
    assert push_events(None, {"step": 1, "pushesFellBack": 0}) == []
