"""The operator next to other tenants' workloads: the API server sends it only the children it
labelled (``kuberl_operator.watches``: server-side label selectors), so another team's pods and
ConfigMaps cost it nothing — no watch event, no kopf worker, no memory — however many they are."""

from __future__ import annotations

import pytest

from kuberl.api.contract import LABEL_ROLE

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_operator import experiment, get_rlx

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
