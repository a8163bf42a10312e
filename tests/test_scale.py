"""Resizing inference while a run goes on: the scale subresource of an RLExperiment (its pool follows)
and of a standalone InferencePool, through the real kubectl and the way an HPA uses it."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from kuberl.api.contract import LABEL_ROLE

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_chart import K8S_VERSION, TOOLS
from .test_kubectl import kubectl
from .test_operator import experiment, get_rlx

pytestmark = pytest.mark.integration
INFERENCE = f"{LABEL_ROLE}=inference"


async def all_ready(api, namespace: str = "team-a") -> None:
    """Play the kubelet: every pod not yet Running is Running and Ready."""
    for pod in pods(api, namespace):
        if (pod.get("status") or {}).get("phase") != "Running":
            await set_pod(api, pod, "Running", ready=True)


@pytest.mark.slow
async def test_kubectl_scale_resizes_an_experiments_inference_and_its_scale_reads_back(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api, cfg = cluster.api, cluster.kubeconfig
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        await all_ready(api)
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(api, "team-a")}
        out = await kubectl(cfg, "scale", "rlx", "cpu-tiny", "-n", "team-a", "--replicas=3")
        assert "scaled" in out
        await eventually(lambda: len(pods(api, "team-a", INFERENCE)) == 3, what="3 replicas")
        assert api.get(GROUP, "rlexperiments", "team-a", "cpu-tiny")["spec"]["inference"]["replicas"] == 3
        assert api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")["spec"]["replicas"] == 3
        await all_ready(api)
        await eventually(lambda: get_rlx(api, "cpu-tiny").get("status", {}).get("readyReplicas") == 3, what="3 ready")
        # the running trainer and replica stay (the trainer follows its pool in the mounted run config)
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(api, "team-a")}
        assert len(before) == 2 and all(now.get(name) == uid for name, uid in before.items()), (before, now)
        config = api.get("", "configmaps", "team-a", "cpu-tiny-config")
        assert yaml.safe_load(next(iter(config["data"].values())))["spec"]["inference"]["replicas"] == 3

        path = f"/apis/{GROUP}/v1alpha1/namespaces/team-a/rlexperiments/cpu-tiny/scale"
        raw = await kubectl(cfg, "get", "--raw", path)
        scale = json.loads(raw)
        assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 3, 3)
        selected = pods(api, "team-a", scale["status"]["selector"])
        assert sorted(p["metadata"]["name"] for p in selected) == sorted(
            p["metadata"]["name"] for p in pods(api, "team-a", INFERENCE))  # the inference pods, no trainer

        await kubectl(cfg, "scale", "rlx", "cpu-tiny", "-n", "team-a", "--replicas=1")
        await eventually(lambda: [p["metadata"]["name"] for p in pods(api, "team-a", INFERENCE)]
                         == ["cpu-tiny-inference-r0-h0"], what="back to one replica")
        await eventually(lambda: get_rlx(api, "cpu-tiny").get("status", {}).get("replicas") == 1, what="status 1")


@pytest.mark.slow
async def test_a_standalone_pool_scales_with_kubectl_scale_rlpool(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api, cfg = cluster.api, cluster.kubeconfig
        await api.create(GROUP, "inferencepools", "team-a", {"metadata": {"name": "evals"}, "spec": {"replicas": 1}})
        await eventually(lambda: len(pods(api, "team-a")) == 1, what="one replica")
        await kubectl(cfg, "scale", "rlpool", "evals", "-n", "team-a", "--replicas=2")
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="two replicas")
        await all_ready(api)
        pool = await eventually(lambda: (p := api.get(GROUP, "inferencepools", "team-a", "evals")).get(
            "status", {}).get("readyReplicas") == 2 and p, what="2 ready")
        assert pool["status"]["selector"] == "kuberl.io/inference-pool=evals,kuberl.io/role=inference"


@pytest.mark.slow
async def test_a_gang_scheduled_experiment_resizes_its_pod_group_with_it(tmp_path):
    """Volcano's PodGroup counts every pod of the experiment: its minMember follows a scale (else a
    gang restart after a scale-down would wait for pods that are never coming back)."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api, cfg = cluster.api, cluster.kubeconfig
        doc = experiment("gpu-gsm8k-grpo")
        name = doc["metadata"]["name"]
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        await eventually(lambda: len(pods(api, "team-a")) == 3, what="2 replicas and a trainer")

        def min_member() -> int:
            [group] = api.list("scheduling.volcano.sh", "podgroups", "team-a")
            return group["spec"]["minMember"]

        assert min_member() == 3
        await kubectl(cfg, "scale", "rlx", name, "-n", "team-a", "--replicas=4")
        await eventually(lambda: len(pods(api, "team-a")) == 5 and min_member() == 5, what="a gang of 5")
        await kubectl(cfg, "scale", "rlx", name, "-n", "team-a", "--replicas=1")
        await eventually(lambda: len(pods(api, "team-a")) == 2 and min_member() == 2, what="a gang of 2")


def horizontal_pod_autoscaler(kind: str, name: str) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"{name}-inference", "namespace": "team-a"},
            "spec": {"scaleTargetRef": {"apiVersion": f"{GROUP}/v1alpha1", "kind": kind, "name": name},
                     "minReplicas": 1, "maxReplicas": 4,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                                   "target": {"type": "Utilization",
                                                                              "averageUtilization": 80}}}]}}


@pytest.mark.slow
async def test_an_hpa_can_drive_an_experiment_through_its_scale_subresource(tmp_path):
    """What the HPA controller does with its scaleTargetRef — read the target's /scale, measure the pods
    its status.selector selects, write spec.replicas — done by the test (no controller-manager here);
    the HPA itself is a valid autoscaling/v2 object (kubernetes-validate, 1.35's schema)."""
    hpa = horizontal_pod_autoscaler("RLExperiment", "cpu-tiny")
    manifest = tmp_path / "hpa.yaml"
    manifest.write_text(yaml.safe_dump(hpa))
    done = subprocess.run([str(TOOLS / "kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "passed for resource" in done.stdout, done.stdout + done.stderr
    ref = hpa["spec"]["scaleTargetRef"]
    path = f"/apis/{ref['apiVersion']}/namespaces/team-a/rlexperiments/{ref['name']}/scale"
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api, cfg = cluster.api, cluster.kubeconfig
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        await all_ready(api)
        scale = await eventually(lambda: (s := api_scale(api)) and s["status"]["selector"] and s, what="a selector")
        assert [p["metadata"]["name"] for p in pods(api, "team-a", scale["status"]["selector"])] == [
            "cpu-tiny-inference-r0-h0"]
        desired = min(hpa["spec"]["maxReplicas"], 2 * scale["status"]["replicas"])  # utilisation at twice the target
        doc = {**scale, "spec": {"replicas": desired}}
        written = json.loads(await kubectl_put_raw(cfg, path, doc, tmp_path))
        assert written["spec"]["replicas"] == 2
        await eventually(lambda: len(pods(api, "team-a", INFERENCE)) == 2, what="the HPA's 2 replicas")


def api_scale(api) -> dict:
    from .kube_objects import scale_of

    kind = api.kind_of(GROUP, "rlexperiments")
    return scale_of(api.get(GROUP, "rlexperiments", "team-a", "cpu-tiny"), kind.scale)


async def kubectl_put_raw(cfg, path: str, doc: dict, tmp_path) -> str:
    body = tmp_path / "scale.json"
    body.write_text(json.dumps(doc))
    return await kubectl(cfg, "replace", "--raw", path, "-f", str(body))
