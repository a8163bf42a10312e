"""spec.inference.autoscale: the pure rule (kuberl.api.autoscale) by hand and as properties, and
the operator applying it from a real trainer progress endpoint on the emulated cluster — through the
scale subresource its RBAC grants, with an Event and status.autoscale."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.autoscale import decide
from kuberl.api.spec import AutoscaleSpec

from .harness import GROUP, bind, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_operator import experiment, get_rlx, trainer_progress

SPEC = AutoscaleSpec(min_replicas=1, max_replicas=4, target_wait_fraction=0.2, window_seconds=60)


@pytest.mark.parametrize(("replicas", "wait", "since", "expected"), [
    (1, 0.5, None, 2),  # the trainer waits half its step: one more replica
    (2, 0.5, 61.0, 3),  # a window has passed since the last change
    (2, 0.5, 30.0, None),  # within the window: hold
    (4, 0.9, None, None),  # at the maximum
    (3, 0.05, 61.0, 2),  # hardly waits: one fewer
    (3, 0.15, 61.0, None),  # in the band [target/2, target]: hold
    (1, 0.0, 61.0, None),  # at the minimum
    (6, 0.0, 5.0, 4),  # outside the bounds (a spec edit): the bound at once, window or not
    (2, None, None, None),  # no measurement yet
])  # fmt: skip
def test_the_rule_by_hand(replicas, wait, since, expected):
    decision = decide(replicas, wait, SPEC, since)
    assert (decision.replicas if decision else None) == expected


@pytest.mark.parametrize(("replicas", "since", "too_few", "expected", "remembered"), [
    (3, 61.0, 2, None, None),  # 2 was too few a window ago: stay at 3
    (3, 6 * 60.0, 2, 2, None),  # six windows later the memory has faded: try 2 again
    (4, 61.0, 2, 3, 2),  # 3 was never found too few: one fewer, 2 still remembered
    (3, 61.0, None, 2, None),  # nothing remembered
])  # fmt: skip
def test_a_count_found_too_few_is_not_returned_to_while_it_is_remembered(replicas, since, too_few, expected,
                                                                          remembered):
    """The trainer hardly waits (3 %, under half the 20 % target) in every case."""
    decision = decide(replicas, 0.03, SPEC, since, too_few)
    assert (decision.replicas if decision else None) == expected
    assert decision is None or decision.too_few == remembered


def test_a_scale_up_remembers_the_count_it_left():
    decision = decide(2, 0.5, SPEC, 61.0, too_few=1)
    assert decision is not None and (decision.replicas, decision.too_few) == (3, 2)


@given(st.integers(1, 8), st.floats(0, 1), st.none() | st.floats(0, 1000), st.integers(1, 4), st.integers(0, 4),
       st.none() | st.integers(0, 8))
def test_the_rule_stays_in_bounds_and_moves_one_step_at_most(replicas, wait, since, low, extra, too_few):
    spec = SPEC.model_copy(update={"min_replicas": low, "max_replicas": low + extra})
    decision = decide(replicas, wait, spec, since, too_few)
    if decision is None:
        return
    assert low <= decision.replicas <= low + extra
    if low <= replicas <= low + extra:
        assert abs(decision.replicas - replicas) == 1 and (since is None or since >= SPEC.window_seconds)


@pytest.mark.slow
@pytest.mark.integration
async def test_the_operator_grows_a_pool_whose_trainer_waits_and_then_holds_for_the_window(tmp_path, monkeypatch):
    from .test_chart import VARIANTS, _rules, render

    doc = experiment()
    doc["spec"]["inference"]["autoscale"] = {"minReplicas": 1, "maxReplicas": 3, "targetWaitFraction": 0.2,
                                             "windowSeconds": 3600}
    async with trainer_progress(monkeypatch) as server, emulated_cluster(tmp_path) as cluster, \
            running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        for pod in pods(api, "team-a"):
            await bind(api, pod, "node-a")
            await set_pod(api, pod, "Running", ready=True)
        server.update(step=3, version=3, rollout_wait_fraction=0.6)  # rollouts are the bottleneck
        exp = await eventually(  # the scale, then the status: two writes, the second may land a moment later
            lambda: (e := get_rlx(api, "cpu-tiny"))["spec"]["inference"]["replicas"] == 2 and "autoscale" in e["status"]
            and e, what="2 replicas and status.autoscale")
        assert exp["status"]["autoscale"]["replicas"] == 2 and "60%" in exp["status"]["autoscale"]["reason"]
        assert exp["status"]["autoscale"]["tooFew"] == 1  # remembered: no return to 1 replica for a while
        await eventually(lambda: len(pods(api, "team-a", "kuberl.io/role=inference")) == 2, what="a second replica")
        for pod in pods(api, "team-a"):  # the kubelet's part: the new replica runs (the experiment stays Running)
            if (pod.get("status") or {}).get("phase") != "Running":
                await bind(api, pod, "node-a")
                await set_pod(api, pod, "Running", ready=True)
        events = await eventually(lambda: [e for e in api.list("", "events", "team-a") if e["reason"] == "Autoscaled"],
                                  what="the Autoscaled Event")
        assert len(events) == 1 and events[0]["type"] == "Normal" and "1 → 2" in events[0]["message"]
        for step in (4, 5):  # still waiting, but within the window: no second change
            server.update(step=step, version=step, rollout_wait_fraction=0.6)
            await eventually(lambda s=step: get_rlx(api, "cpu-tiny")["status"]["progress"]["step"] == s, what="step")
        await asyncio.sleep(0.5)
        assert get_rlx(api, "cpu-tiny")["spec"]["inference"]["replicas"] == 2
        used = {(group, resource, verb) for verb, group, resource in api.used}
    granted = {(group, res, verb) for rule in _rules(render(VARIANTS["namespaced-everything-on"]))
               for group in rule["apiGroups"] for res in rule["resources"] for verb in rule["verbs"]}
    assert (GROUP, "rlexperiments/scale", "patch") in used & granted


def test_the_trainers_wait_fraction_covers_its_last_ten_steps_after_the_first():
    from kuberl.trainer.services import fraction_of_steps

    steps, waits = [5.0] + [0.1] * 10, [4.9] + [0.02] * 10  # the first step waited for the start-up
    assert fraction_of_steps(waits[:10], steps[:10]) is None
    assert fraction_of_steps(waits, steps) == 0.2  # Σ 0.2 s waited ÷ Σ 1 s, the first step left out
    assert fraction_of_steps([0.0] * 10 + [3.0], [1.0] * 11) == 0.3
