"""``kuberl top``'s screen (kuberl_cli.top.frame, pure) and its cluster source read through the API as
``kubectl proxy`` serves it. (Its local source, in a terminal, watches a resized run in test_local_run.py.)"""

from __future__ import annotations

import asyncio

import pytest

from kuberl.api import Progress
from kuberl_cli.top import Replica, View, cluster_source, frame, sparkline

from .harness import GROUP, emulated_cluster
from .test_operator import experiment

PROGRESS = {"step": 12, "maxSteps": 100, "version": 12, "reward": 0.5, "rewardFirst10": 0.3, "rewardLast10": 0.45,
            "observedStaleness": 2, "rolloutWaitFraction": 0.25, "rolloutReadyGroups": 3, "promptsTrained": 192,
            "evalReward": 0.41, "evalStep": 10, "evalVersion": 10, "evalVersionSpan": 1,
            "lastPush": {"version": 12, "mode": "p2p", "transport": "gloo over TCP", "bytesPerReplica": 2_400_000,
                         "seconds": 0.02, "gigabytesPerSecond": 0.12, "replicas": 2, "slowestReplica": "http://r1",
                         "slowestRatio": 2.5}}


def test_the_screen_shows_the_steps_reward_curve_staleness_wait_replicas_and_last_push():
    view = View("/tmp/run", replicas=[Replica("http://r0", "ok", 12, 3), Replica("http://r1", "unreachable")])
    for step, reward in enumerate([0.1, 0.2, 0.2, 0.4, 0.5], start=8):
        view.seen(Progress.from_reply({**PROGRESS, "step": step, "reward": reward}))
    view.seen(Progress.from_reply({**PROGRESS, "step": 12, "reward": 0.5}))  # the same step polled again
    text = "\n".join(frame(view, "12:00:00"))
    assert "step 12/100" in text and "reward 0.500  ▁▃▃▇█  (last 5 steps seen" in text
    assert "eval 0.410 at step 10 (version 10, span 1)" in text
    assert "staleness 2" in text and "waiting for rollouts 25%" in text and "prompts trained 192" in text
    assert ("last push v12 p2p (gloo over TCP) 2.4 MB/replica in 0.020 s (0.12 GB/s) to 2 replica(s), slowest "
            "http://r1 ×2.5") in text
    assert "http://r0  ok  version 12  in flight 3" in text and "http://r1  unreachable  version –" in text
    assert frame(View("x"), "t")[-1].startswith("waiting for the trainer")


def test_a_sparkline_scales_between_its_extremes():
    assert sparkline([]) == "" and sparkline([1.0, 1.0]) == "▁▁"
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"


@pytest.mark.integration
async def test_the_cluster_source_reads_the_experiments_status_through_the_api(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"status": {
            "phase": "Running", "progress": PROGRESS, "replicas": 2, "readyReplicas": 1}}, subresource="status")
        view = View("team-a/cpu-tiny")
        going = await asyncio.to_thread(cluster_source(cluster.url, "team-a", "cpu-tiny"), view)
        text = "\n".join(frame(view, "t"))
        assert going and "phase Running   step 12/100" in text and "replicas 1 ready of 2" in text
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"status": {"phase": "Succeeded"}},
                        subresource="status")
        assert not await asyncio.to_thread(cluster_source(cluster.url, "team-a", "cpu-tiny"), view)
        with pytest.raises(ValueError, match="HTTP 404"):
            await asyncio.to_thread(cluster_source(cluster.url, "team-a", "nope"), view)
