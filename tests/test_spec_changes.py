"""Spec changes reach the children: removed fields leave them, pods whose template changed are
replaced (the trainer gang whole, the inference pool one replica at a time)."""

from __future__ import annotations

import asyncio
import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.contract import ANNOTATION_TEMPLATE_HASH, LABEL_REPLICA
from kuberl_operator.patch import merge_patch_to
from kuberl_operator.replacement import pods_to_replace

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .kube_emulator import ApiError
from .kube_objects import merge_patch
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


@pytest.mark.integration
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


def exists(api, group: str, plural: str, name: str) -> bool:
    try:
        return bool(api.get(group, plural, "team-a", name))
    except ApiError as err:
        if err.status == 404:
            return False
        raise


def trainer_gangs(api) -> dict[str, list[str]]:
    """The trainer pods there are, by who made them: our own (native) or a PyTorchJob."""
    out: dict[str, list[str]] = {}
    for p in pods(api, "team-a", "kuberl.io/role=trainer"):
        owner = next(r["kind"] for r in p["metadata"]["ownerReferences"] if r.get("controller"))
        out.setdefault(owner, []).append(p["metadata"]["name"])
    return out


@pytest.mark.integration
async def test_a_runtime_switch_ends_with_one_gang_and_never_runs_two(tmp_path):
    """native → kubeflow → native: the old runtime's gang (our rank pods, or the PyTorchJob and its
    pods) goes before the new one starts; the test plays the Kubeflow operator (it makes the master
    pod, owned by the PyTorchJob) and checks at every event that at most one gang exists."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: trainer_gangs(api) == {"TrainerJob": ["cpu-tiny-trainer-n0"]}, what="native gang")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"trainer": {"runtime": "kubeflow"}}})
        (job,) = await eventually(lambda: api.list("kubeflow.org", "pytorchjobs", "team-a"), what="PyTorchJob")
        assert trainer_gangs(api) == {}  # the native gang was gone before the PyTorchJob was made
        owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job["metadata"]["name"],
                 "uid": job["metadata"]["uid"], "controller": True}
        template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
        await api.create("", "pods", "team-a", {"metadata": {
            "name": "cpu-tiny-trainer-master-0", "labels": template["metadata"]["labels"], "ownerReferences": [owner]},
            "spec": template["spec"]})  # fmt: skip
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"trainer": {"runtime": "native"}}})
        gangs = await eventually(lambda: trainer_gangs(api).get("TrainerJob") and trainer_gangs(api),
                                 what="the native gang back")
        assert gangs == {"TrainerJob": ["cpu-tiny-trainer-n0"]}  # the PyTorchJob's master went with its job
        assert api.list("kubeflow.org", "pytorchjobs", "team-a") == []


@pytest.mark.integration
async def test_removing_the_agent_removes_its_deployment_service_and_token(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment("cpu-agent-gateway"))
        agent_objects = [("apps", "deployments", "cpu-agent-gateway-agent"),
                         ("", "services", "cpu-agent-gateway-gateway"),
                         ("", "secrets", "cpu-agent-gateway-agent-token")]

        def present() -> list[str]:
            return [name for group, plural, name in agent_objects if exists(api, group, plural, name)]

        await eventually(lambda: len(present()) == 3, what="the agent's objects")
        edited = api.get(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway")
        del edited["spec"]["agent"]
        await api.update(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway", edited)
        await eventually(lambda: present() == [], what="the agent's objects gone")
        assert api.get("", "secrets", "team-a", "cpu-agent-gateway-api-token")  # the experiment's own stays


@pytest.mark.slow
@pytest.mark.integration
async def test_a_recreated_token_secret_replaces_every_pod_that_holds_the_old_token(tmp_path, monkeypatch):
    """Deleting the API token Secret makes a new token; pods started with the old one would get 401
    from each other until their backoff runs out. They are replaced (the trainer gang whole, the
    replicas one at a time, the agent's Deployment rolls), standalone pools alike. (The operator
    re-reads a token Secret every KUBERL_SECRET_RECHECK_SECONDS, 60 by default; 1 here.)"""
    monkeypatch.setenv("KUBERL_SECRET_RECHECK_SECONDS", "1")
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment("cpu-agent-gateway"))
        before = await eventually(lambda: len(pods(api, "team-a")) == 2 and pods(api, "team-a"), what="2 pods")
        for p in before:
            await set_pod(api, p, "Running", ready=True)
        uids = {p["metadata"]["uid"] for p in before}
        agent_template = api.get("apps", "deployments", "team-a", "cpu-agent-gateway-agent")["spec"]["template"]
        await api.delete("", "secrets", "team-a", "cpu-agent-gateway-api-token")
        await asyncio.sleep(1.5)  # the operator's memory of the Secret expires
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway", {"metadata": {"labels": {"x": "1"}}})

        def replaced() -> list[dict]:
            now = pods(api, "team-a")
            return len(now) == 2 and not uids & {p["metadata"]["uid"] for p in now} and now

        await eventually(replaced, what="both pods replaced")
        rolled = api.get("apps", "deployments", "team-a", "cpu-agent-gateway-agent")["spec"]["template"]
        assert rolled["metadata"]["annotations"] != agent_template["metadata"]["annotations"]

        standalone = {"apiVersion": "kuberl.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "solo"},
                      "spec": {"replicas": 1}}
        await api.create(GROUP, "inferencepools", "team-a", standalone)
        (solo,) = await eventually(lambda: pods(api, "team-a", "kuberl.io/inference-pool=solo"), what="solo pod")
        await api.delete("", "secrets", "team-a", "solo-api-token")
        await asyncio.sleep(1.5)
        await api.patch(GROUP, "inferencepools", "team-a", "solo", {"metadata": {"labels": {"x": "1"}}})
        await eventually(lambda: [p["metadata"]["uid"] for p in pods(api, "team-a", "kuberl.io/inference-pool=solo")]
                         not in ([], [solo["metadata"]["uid"]]), what="the standalone replica replaced")
