"""The operator next to other tenants' workloads: the API server sends it only the children it
labelled (``kuberl_operator.watches``: server-side label selectors), so another team's pods and
ConfigMaps cost it nothing — no watch event, no kopf worker, no memory — however many they are; and
no tenant's object borrows another's Secrets or a queue its namespace may not use."""

from __future__ import annotations

import pytest

from kuberl.api.contract import LABEL_ROLE

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_operator import condition, experiment, get_rlx

pytestmark = pytest.mark.integration
CHILDREN = (("", "configmaps"), ("", "services"), ("networking.k8s.io", "networkpolicies"), ("", "pods"))


def foreign(kind: str, name: str) -> dict:
    """Another tenant's object in the same namespace: no KubeRL label."""
    obj: dict = {"metadata": {"name": name, "labels": {"app": "their-service"}}}
    if kind == "pods":
        obj["spec"] = {"containers": [{"name": "main", "image": "their/image:1"}]}
    else:
        obj["data"] = {"k": "v"}
    return obj


async def test_other_tenants_pods_and_configmaps_never_reach_the_operator(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        for i in range(5):  # there before the operator starts: its first list must not bring them
            await api.create("", "pods", "team-a", foreign("pods", f"theirs-before-{i}"))
        async with running_operator(cluster):
            await api.create(GROUP, "rlexperiments", "team-a", experiment())
            ours = await eventually(lambda: pods(api, "team-a", LABEL_ROLE) or None, what="the experiment's pods")
            for i in range(5):  # created and changed while its watches are open
                await api.create("", "pods", "team-a", foreign("pods", f"theirs-{i}"))
                await api.create("", "configmaps", "team-a", foreign("configmaps", f"theirs-{i}"))
                await api.patch("", "pods", "team-a", f"theirs-{i}", {"status": {"phase": "Running"}},
                                subresource="status")
            for pod in ours:
                await set_pod(api, pod, "Running", ready=True)
            await eventually(lambda: get_rlx(api, "cpu-tiny").get("status", {}).get("phase") == "Running",
                             what="Running")
        theirs = {key: n for key, n in api.delivered.items() if key[1].startswith("theirs")}
        assert theirs == {}, f"other tenants' objects sent to the operator: {theirs}"
        children = [(plural, obj["metadata"]["name"]) for group, plural in CHILDREN
                    for obj in api.list(group, plural, "team-a") if obj["metadata"].get("ownerReferences")]
        assert len(children) == 6, children  # ConfigMap, 2 Services, NetworkPolicy, 2 pods
        assert [child for child in children if not api.delivered[child]] == [], "its own children not watched"
        assert all(api.delivered[("pods", p["metadata"]["name"])] >= 2 for p in ours)  # ADDED, Running


async def test_no_pod_is_created_before_its_network_policy_and_config_exist(tmp_path):
    """The NetworkPolicy that fences an experiment's pods from other tenants, and the ConfigMap they
    read, are stored before the pool, job or any pod is created (``children.ensure_in_stages``)."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a", LABEL_ROLE)) == 2, what="pods")
        created = [key[1] for _, key, kind, _ in api.log if kind == "ADDED"]
        fenced = max(created.index("networkpolicies"), created.index("configmaps"))
        assert fenced < min(created.index(plural) for plural in ("inferencepools", "trainerjobs", "pods")), created


BORROWED = {  # a standalone object naming another experiment's managed Secrets
    "InferencePool": {"engine": "torch", "storage": {"credentialsSecret": "victim-api-token"}},
    "TrainerJob": {"storage": {"hubTokenSecret": {"name": "victim-checkpoint-key", "key": "key"}},
                   "logging": {"wandb": {"project": "p", "apiKeySecret": {"name": "victim-agent-token", "key": "t"}}}},
}


async def test_a_standalone_pool_or_job_cannot_borrow_an_experiments_secrets(tmp_path):
    """Issue 69, item 3: an InferencePool or TrainerJob created on its own may not name another
    experiment's API token, agent token or checkpoint key in storage or logging — it would receive it
    as env. Refused (SpecValid=False naming the field), no pod; the same objects fail kuberl validate."""
    from kuberl.api import validate_document

    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        for kind, spec in BORROWED.items():
            body = {"apiVersion": f"{GROUP}/v1alpha1", "kind": kind, "metadata": {"name": "borrower"}, "spec": spec}
            _, issues = validate_document(body)
            fields = {issue.path for issue in issues}
            assert fields == ({"spec.storage.credentialsSecret"} if kind == "InferencePool" else
                              {"spec.storage.hubTokenSecret.name", "spec.logging.wandb.apiKeySecret.name"}), issues
            plural = f"{kind.lower()}s"
            await api.create(GROUP, plural, "team-a", body)
            refused = await eventually(lambda p=plural: condition(api.get(GROUP, p, "team-a", "borrower"), "SpecValid"),
                                       what=f"SpecValid on the {kind}")
            assert refused["status"] == "False" and all(f in refused["message"] for f in fields), refused
        assert pods(api, "team-a") == []


async def test_a_namespace_uses_only_the_queues_and_priority_classes_the_admin_allows(tmp_path, monkeypatch):
    """Issue 69, item 8: with the chart's tenancy allowlist, an experiment (or a standalone pool) naming
    another team's Volcano queue or a PriorityClass its namespace may not use is refused naming the
    field, with no pod; one naming its own is served."""
    import json

    monkeypatch.setenv("KUBERL_ALLOWED_QUEUES", json.dumps({"team-a": ["team-a-queue"], "*": ["shared"]}))
    monkeypatch.setenv("KUBERL_ALLOWED_PRIORITY_CLASSES", json.dumps({"*": ["rl-batch"]}))
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        greedy = experiment()
        greedy["metadata"]["name"] = "greedy"
        greedy["spec"]["scheduling"] = {"gang": "volcano", "queue": "shared", "priorityClassName": "system-critical"}
        await api.create(GROUP, "rlexperiments", "team-a", greedy)
        pool = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferencePool", "metadata": {"name": "borrower"},
                "spec": {"engine": "torch", "scheduling": {"gang": "volcano", "queue": "team-b-queue"}}}
        await api.create(GROUP, "inferencepools", "team-a", pool)
        for plural, name, fields in (("rlexperiments", "greedy", ("spec.scheduling.queue",
                                                                  "spec.scheduling.priorityClassName")),
                                     ("inferencepools", "borrower", ("spec.scheduling.queue",))):
            refused = await eventually(lambda p=plural, n=name: condition(api.get(GROUP, p, "team-a", n), "SpecValid"),
                                       what=f"SpecValid on {name}")
            assert refused["status"] == "False" and all(f in refused["message"] for f in fields), refused
        assert pods(api, "team-a") == []
        own = experiment()
        own["spec"]["scheduling"] = {"gang": "volcano", "queue": "team-a-queue", "priorityClassName": "rl-batch"}
        await api.create(GROUP, "rlexperiments", "team-a", own)
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="the allowed experiment's pods")
