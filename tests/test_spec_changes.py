"""Spec changes reach the children: removed fields leave them, pods whose template changed are
replaced (the trainer gang whole, the inference pool one replica at a time)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.contract import ANNOTATION_TEMPLATE_HASH, LABEL_REPLICA
from kuberl_operator.patch import merge_patch_to
from kuberl_operator.replacement import pods_to_replace

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .kube_emulator import merge_patch
from .test_operator import experiment

json_values = st.recursive(st.booleans() | st.integers() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=2), inner, max_size=3), max_leaves=12)
json_objects = st.dictionaries(st.text(max_size=2), json_values, max_size=4)


@given(json_objects, json_objects)
def test_the_merge_patch_turns_the_stored_object_into_the_desired_one(current, desired):
    """Applied the way an API server applies a merge patch (the emulator's RFC 7386 code)."""
    assert merge_patch(copy.deepcopy(current), merge_patch_to(current, desired)) == desired


def pod(name: str, template: str | None, replica: int = 0, ready: bool = True, terminating: bool = False) -> dict:
    meta: dict = {"name": name, "labels": {LABEL_REPLICA: str(replica)},
                  "annotations": {ANNOTATION_TEMPLATE_HASH: template} if template else {}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_a_changed_gang_is_replaced_whole():
    desired = {"job-n0": "new", "job-n1": "new"}
    assert pods_to_replace(desired, [pod("job-n0", "new"), pod("job-n1", "old")], gang=True) == ["job-n0", "job-n1"]
    assert pods_to_replace(desired, [pod("job-n0", "new"), pod("job-n1", "new")], gang=True) == []


@pytest.mark.parametrize(("pool", "expected"), [
    ([pod("r0", "old", 0), pod("r1", "old", 1)], ["r0"]),  # one ready replica at a time
    ([pod("r0", "new", 0), pod("r1", "old", 1)], ["r1"]),
    ([pod("r0", "new", 0, ready=False), pod("r1", "old", 1)], []),  # the new one is not ready yet: wait
    ([pod("r0", "old", 0, terminating=True), pod("r1", "old", 1)], []),  # one is going away: wait
    ([pod("r1", "old", 1)], []),  # r0 is missing (being recreated): wait
    ([pod("r0", "old", 0, ready=False), pod("r1", "old", 1, ready=False)], ["r0", "r1"]),  # not serving: at once
    ([pod("r0", None, 0), pod("r1", None, 1)], []),  # made by an older operator: left alone
])
def test_an_inference_pool_rolls_one_replica_at_a_time(pool, expected):
    assert pods_to_replace({"r0": "new", "r1": "new"}, pool, gang=False) == expected


async def test_a_spec_edit_reaches_the_children_and_replaces_their_pods(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        doc = experiment()
        doc["spec"]["inference"]["nodeSelector"] = {"pool": "cpu"}
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        before = await eventually(lambda: len(pods(api, "team-a")) == 2 and pods(api, "team-a"), what="2 pods")
        for p in before:
            await set_pod(api, p, "Running", ready=True)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in before}

        edited = api.get(GROUP, "rlexperiments", "team-a", "cpu-tiny")
        del edited["spec"]["inference"]["nodeSelector"]  # a removed field
        edited["spec"]["algorithm"]["learningRate"] = 1e-4  # only the run config changes
        await api.update(GROUP, "rlexperiments", "team-a", "cpu-tiny", edited)

        def replaced() -> list[dict]:
            now = pods(api, "team-a")
            return len(now) == 2 and all(uids.get(p["metadata"]["name"]) != p["metadata"]["uid"] for p in now) and now

        after = await eventually(replaced, what="both pods replaced")
        pool = api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")
        assert "nodeSelector" not in pool["spec"]
        config = api.get("", "configmaps", "team-a", "cpu-tiny-config")["data"]["experiment.yaml"]
        assert "learningRate: 0.0001" in config
        inference = next(p for p in after if p["metadata"]["labels"]["kuberl.io/role"] == "inference")
        assert "nodeSelector" not in inference["spec"]
        revisions = {p["metadata"]["annotations"]["kuberl.io/config-revision"] for p in after}
        assert revisions == {pool["spec"]["configRevision"]}
