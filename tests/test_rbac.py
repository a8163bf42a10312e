"""The chart's RBAC against what the operator really asks for: a tour of everything it does, every
request recorded by the emulated API server."""

from __future__ import annotations

import pytest

from .harness import GROUP, bind, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_operator import experiment, get_rlx

pytestmark = pytest.mark.integration


# Granted but never a request: what the API server checks on the operator's behalf, or what kopf
# reads outside the emulator's kinds (each with why it stays).
GRANTED_NOT_CALLED = {
    ("rlexperiments/finalizers", "update"): "children's blockOwnerDeletion (OwnerReferencesPermissionEnforcement)",
    ("inferencepools/finalizers", "update"): "the same, for pool children",
    ("trainerjobs/finalizers", "update"): "the same, for job children",
    ("rlexperiments/scale", "patch"): "the autoscaler's write (tests/test_autoscale.py: granted and used there)",
    ("customresourcedefinitions", "list"): "kopf's discovery of the watched kinds",
    ("customresourcedefinitions", "watch"): "kopf's discovery of the watched kinds",
    **{(kind, "get"): "read from the API server only when a create answered 409 (whose object has the name?); "
                      "every other read comes from the watches"
       for kind in ("inferencepools", "trainerjobs", "pods", "configmaps", "services", "networkpolicies",
                    "deployments", "pytorchjobs", "trainjobs")},
}


@pytest.mark.slow
async def test_the_charts_rbac_grants_exactly_what_the_operator_asks_for(tmp_path):
    """A tour of everything the operator does — two experiments (an agent and a Volcano gang; a
    Kubeflow runtime and a coscheduling gang), both resized, a node's topology, a tampered policy, a failure that
    becomes an Event, suspend, the agent removed, runtime switches (kubeflow → trainjob → native), a third
    that fails and leaves a post-mortem —
    recording every request the emulator gets. The chart's RBAC (every integration on) must cover each
    request and grant nothing else but GRANTED_NOT_CALLED."""
    from kuberl.local import apply_overrides

    from .kube_emulator import Fault
    from .test_chart import VARIANTS, _rules, render

    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster, namespaces=["team-a"]):
        api = cluster.api
        await api.create("", "nodes", None, {"metadata": {"name": "node-a", "labels": {
            "topology.kubernetes.io/zone": "z1"}}})  # fmt: skip
        api.faults.append(Fault("POST", "configmaps", 422, times=1))  # not transient: Degraded + an Event
        await api.create(GROUP, "rlexperiments", "team-a", apply_overrides(
            experiment("cpu-agent-gateway"), ["scheduling.gang=volcano"]))
        await api.create(GROUP, "rlexperiments", "team-a", apply_overrides(
            experiment(), ["trainer.runtime=kubeflow", "scheduling.gang=coscheduling"]))
        await eventually(lambda: len(pods(api, "team-a")) == 3 and api.list("kubeflow.org", "pytorchjobs", "team-a"),
                         what="pods and the PyTorchJob")
        await bind(api, pods(api, "team-a")[0], "node-a")
        for name in ("cpu-agent-gateway", "cpu-tiny"):  # a resize patches each gang's PodGroup (issue 69, item 6)
            await api.patch(GROUP, "rlexperiments", "team-a", name, {"spec": {"inference": {"replicas": 2}}})
        await eventually(lambda: {("patch", "scheduling.volcano.sh", "podgroups"),
                                  ("patch", "scheduling.x-k8s.io", "podgroups")} <= api.used,
                         what="both PodGroups resized")
        await api.patch("networking.k8s.io", "networkpolicies", "team-a", "cpu-tiny",
                        {"spec": {"ingress": []}})  # tampered with: the operator puts it back
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway", {"spec": {
            "agent": {"env": [{"name": "MODE", "value": "fast"}]}}})  # fmt: skip
        policy = ("networking.k8s.io", "networkpolicies", "team-a", "cpu-tiny")
        await eventually(lambda: api.get(*policy)["spec"]["ingress"], what="the policy restored")
        await eventually(lambda: "MODE" in str(api.get("apps", "deployments", "team-a", "cpu-agent-gateway-agent")),
                         what="the agent's Deployment patched")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway", {"spec": {"suspend": True}})
        edited = get_rlx(api, "cpu-agent-gateway")
        del edited["spec"]["agent"]
        await api.update(GROUP, "rlexperiments", "team-a", "cpu-agent-gateway", edited)
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {
            "trainer": {"runtime": "trainjob"}, "scheduling": {"gang": "none"}}})  # fmt: skip
        await eventually(lambda: not api.list("kubeflow.org", "pytorchjobs", "team-a")
                         and api.list("trainer.kubeflow.org", "trainjobs", "team-a"), what="PyTorchJob → TrainJob")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"trainer": {"runtime": "native"}}})
        await eventually(lambda: not api.list("trainer.kubeflow.org", "trainjobs", "team-a")
                         and len(pods(api, "team-a", "kuberl.io/role=trainer")) == 1
                         and not api.list("apps", "deployments", "team-a")
                         and not api.list("", "services", "team-a", "kuberl.io/experiment=cpu-agent-gateway")
                         and "cpu-agent-gateway-agent-token" not in {s["metadata"]["name"]
                                                                     for s in api.list("", "secrets", "team-a")},
                         what="the tour's end (the agent's Deployment, Service and Secret gone)")
        doomed = experiment()
        doomed["metadata"]["name"], doomed["spec"]["trainer"]["backoffLimit"] = "doomed", 0
        await api.create(GROUP, "rlexperiments", "team-a", doomed)
        trainer = await eventually(lambda: next(iter(pods(api, "team-a", "kuberl.io/experiment=doomed,"
                                                                       "kuberl.io/role=trainer")), None),
                                   what="the doomed trainer")
        await set_pod(api, trainer, "Failed", exit_code=1)
        await eventually(lambda: "configMap" in (get_rlx(api, "doomed").get("status") or {}).get("postmortem", {}),
                         what="its post-mortem (Events listed, the trainer's log read)")
        used = {(group, resource, verb) for verb, group, resource in api.used}
    granted = {(group, res, verb) for rule in _rules(render(VARIANTS["namespaced-everything-on"]))
               for group in rule["apiGroups"] for res in rule["resources"] for verb in rule["verbs"]}
    assert used - granted == set(), "the operator asks for what RBAC does not grant"
    unused = {(res, verb) for _, res, verb in granted - used} - set(GRANTED_NOT_CALLED)
    assert unused == set(), f"RBAC grants what the operator never asks for: {sorted(unused)}"
