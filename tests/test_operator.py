"""The real operator against the emulated API server: children, status, suspend, delete, restart."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest

from .conftest import load_example
from .harness import (
    GROUP,
    bind,
    emulated_cluster,
    eventually,
    pods,
    preempt,
    running_experiment,
    running_operator,
    set_pod,
)

pytestmark = pytest.mark.integration


def experiment(name: str = "cpu-tiny", namespace: str = "team-a") -> dict:
    doc = load_example(f"{name}.yaml")
    doc["metadata"]["namespace"] = namespace
    return doc


def get_rlx(api, name, ns="team-a"):
    return api.get(GROUP, "rlexperiments", ns, name)


def condition(obj, kind):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


async def test_cpu_experiment_creates_children_down_to_pods(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        exp = await api.create(GROUP, "rlexperiments", "team-a", experiment())
        all_pods = await eventually(lambda: len(pods(api, "team-a")) == 2 and pods(api, "team-a"), what="2 pods")
        pool = api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")
        job = api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")
        config = api.get("", "configmaps", "team-a", "cpu-tiny-config")
        for child in (pool, job, config):
            assert child["metadata"]["ownerReferences"][0]["uid"] == exp["metadata"]["uid"]
        assert pool["spec"]["engine"] == "torch" and pool["spec"]["replicas"] == 1
        assert {s["metadata"]["name"] for s in api.list("", "services", "team-a")} == {
            "cpu-tiny-inference", "cpu-tiny-trainer"}
        roles = sorted(p["metadata"]["labels"]["kuberl.io/role"] for p in all_pods)
        assert roles == ["inference", "trainer"]
        for pod in all_pods:
            assert pod["metadata"]["labels"]["kuberl.io/experiment"] == "cpu-tiny"
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
            assert not any(k.endswith("/gpu") or "Ascend" in k for k in limits)
        trainer = next(p for p in all_pods if p["metadata"]["labels"]["kuberl.io/role"] == "trainer")
        env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"] == "cpu-tiny-trainer-n0.cpu-tiny-trainer.team-a.svc"
        assert (env["WORLD_SIZE"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("1", "0", "1")
        await eventually(lambda: get_rlx(api, "cpu-tiny").get("status", {}).get("phase") == "Pending",
                         what="phase Pending")


@pytest.mark.parametrize(
    ("example", "resource", "inference", "trainer"),
    [
        ("ascend-qwen3-30b-a3b", "huawei.com/Ascend910", (4, "4"), (2, "16")),
        ("gpu-gsm8k-grpo", "nvidia.com/gpu", (2, "1"), (1, "8")),
    ],
)
async def test_accelerator_examples_get_the_pods_their_allocation_implies(tmp_path, example, resource,
                                                                           inference, trainer):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        doc = experiment(example)
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        total = inference[0] + trainer[0]
        await eventually(lambda: len(pods(api, "team-a")) == total, what=f"{total} pods")
        for role, (count, devices) in (("inference", inference), ("trainer", trainer)):
            members = pods(api, "team-a", f"kuberl.io/role={role}")
            assert len(members) == count
            for pod in members:
                res = pod["spec"]["containers"][0]["resources"]
                assert res["limits"][resource] == devices and res["requests"][resource] == devices
                assert pod["spec"]["schedulerName"] == "volcano"
        if example.startswith("ascend"):
            pod = pods(api, "team-a", "kuberl.io/role=trainer")[0]
            assert pod["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
            assert "HCCL_CONNECT_TIMEOUT" in {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        [group] = api.list("scheduling.volcano.sh", "podgroups", "team-a")  # one gang: pool and trainer together
        assert group["spec"]["minMember"] == total
        assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
                   for p in pods(api, "team-a"))


async def test_status_goes_running_then_succeeded(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        exp = await running_experiment(api, experiment(), pod_count=2)
        assert condition(exp, "Ready")["status"] == "True"
        assert exp["status"]["observedGeneration"] == exp["metadata"]["generation"]
        valid = condition(exp, "SpecValid")  # the example keeps no checkpoint on a cluster: its model would be lost
        assert (valid["status"], valid["reason"]) == ("True", "ValidWithWarnings")
        assert valid["message"].startswith("spec.checkpoint.uri: is unset: on a cluster this run writes no checkpoint")
        trainer = pods(api, "team-a", "kuberl.io/role=trainer")[0]
        await set_pod(api, trainer, "Succeeded", exit_code=0)
        await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["phase"] == "Succeeded", what="Succeeded")


async def quiet_requests(api) -> dict[str, int]:
    """The API requests served so far, once none came for half a second."""
    while True:
        seen = dict(api.requests)
        await asyncio.sleep(0.5)
        if dict(api.requests) == seen:
            return seen


@pytest.mark.slow
async def test_a_new_experiment_reaches_running_without_one_api_read(tmp_path):
    """The operator reads what its watches delivered, creates a new experiment's token Secret without
    looking first and looks for no agent the first spec never had: from create to Running it sends no
    get or list; it creates each child once, and the watch echoes of its own writes trigger nothing
    (a status is written when it changes: experiment, pool and job go Pending → Running)."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        before = await quiet_requests(api)  # kopf's own lists and watches at start-up are over
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        for pod in pods(api, "team-a"):
            await set_pod(api, pod, "Running", ready=True)
        await eventually(lambda: get_rlx(api, "cpu-tiny").get("status", {}).get("phase") == "Running",
                         what="Running")
        after = await quiet_requests(api)  # anything still to come, e.g. a sync an echo set off
        sent = {verb: n - before.get(verb, 0) for verb, n in after.items() if n != before.get(verb, 0)}
        assert sent.get("get", 0) == 0 and sent.get("list", 0) == 0, sent
        assert sent["create"] == 10, sent  # 2 Secrets (token, key), ConfigMap, pool, job, NetPol, 2 Services, 2 pods
        assert sent["patch"] <= 8, sent  # statuses only


@pytest.mark.parametrize(
    ("role", "waiting", "phase"),
    [
        ("trainer", ("ImagePullBackOff", 'Back-off pulling image "nope:1"'), "Failed"),
        ("inference", ("CrashLoopBackOff", "back-off 5m0s restarting failed container"), "Initializing"),
    ],
)
@pytest.mark.slow
async def test_child_failures_surface_on_the_experiment(tmp_path, role, waiting, phase):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        pod = pods(api, "team-a", f"kuberl.io/role={role}")[0]
        await bind(api, pod, "node-a")
        await set_pod(api, pod, "Pending", waiting=waiting)

        def degraded():
            exp = get_rlx(api, "cpu-tiny")
            cond = condition(exp, "Degraded")
            assert cond and cond["status"] == "True", exp.get("status")
            return exp

        exp = await eventually(degraded, what="Degraded condition")
        cond = condition(exp, "Degraded")
        assert cond["reason"] == waiting[0]
        assert pod["metadata"]["name"] in cond["message"] and waiting[1] in cond["message"]
        assert exp["status"]["phase"] == phase


async def test_failed_trainer_restarts_the_gang_then_fails_past_the_backoff_limit(tmp_path):
    doc = experiment()
    doc["spec"]["trainer"]["backoffLimit"] = 1
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        first = pods(api, "team-a", "kuberl.io/role=trainer")[0]
        inference_uid = pods(api, "team-a", "kuberl.io/role=inference")[0]["metadata"]["uid"]
        await bind(api, first, "node-a")
        await set_pod(api, first, "Failed", exit_code=137)

        def restarted():
            trainers = pods(api, "team-a", "kuberl.io/role=trainer")
            return len(trainers) == 1 and trainers[0]["metadata"]["uid"] != first["metadata"]["uid"] and trainers[0]
        second = await eventually(restarted, what="a new trainer pod")
        job = api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")
        assert job["status"]["restarts"] == 1
        cond = condition(job, "GangRestarted")
        assert cond["status"] == "True" and "exit code 137" in cond["message"] and "1/1" in cond["message"]
        assert get_rlx(api, "cpu-tiny")["status"]["phase"] != "Failed"
        assert pods(api, "team-a", "kuberl.io/role=inference")[0]["metadata"]["uid"] == inference_uid  # untouched

        await bind(api, second, "node-a")
        await set_pod(api, second, "Failed", exit_code=1)
        exp = await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["phase"] == "Failed"
                               and get_rlx(api, "cpu-tiny"), what="Failed past the backoff limit")
        cond = condition(exp, "Degraded")
        assert cond["reason"] == "PodFailed" and "exit code 1" in cond["message"]
        assert api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")["status"]["restarts"] == 1


async def test_preemptions_restart_the_gang_without_using_the_backoff_limit_and_a_crash_still_counts(tmp_path):
    """Four preemptions in a row (the DisruptionTarget condition: scheduler preemption, a drain's
    eviction, a taint; Kueue's TerminationTarget for a plain-pod group) of a run with backoffLimit 1:
    each restarts the gang from its checkpoint and the run stays alive, counted as preemptions; then a
    crash uses the one restart it has."""
    doc = experiment()
    doc["spec"]["trainer"]["backoffLimit"] = 1
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        await eventually(lambda: len(pods(api, "team-a", "kuberl.io/role=trainer")) == 1, what="trainer pod")
        takers = (("DisruptionTarget", "PreemptionByScheduler"), ("DisruptionTarget", "EvictionByEvictionAPI"),
                  ("DisruptionTarget", "DeletionByTaintManager"), ("TerminationTarget", "StoppedByKueue"))
        for n, (kind, reason) in enumerate(takers, 1):
            trainer = pods(api, "team-a", "kuberl.io/role=trainer")[0]
            await bind(api, trainer, "node-a")
            await preempt(api, trainer, reason, kind)

            def replaced(old=trainer["metadata"]["uid"]):
                trainers = pods(api, "team-a", "kuberl.io/role=trainer")
                return len(trainers) == 1 and trainers[0]["metadata"]["uid"] != old and trainers[0]
            await eventually(replaced, what=f"a new trainer pod after preemption {n}")
            job = api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")
            assert (job["status"]["preemptions"], job["status"]["restarts"]) == (n, 0)
            cond = condition(job, "GangRestarted")
            assert cond["reason"] == "Preempted" and reason in cond["message"]
            assert "backoffLimit not used" in cond["message"]
        assert get_rlx(api, "cpu-tiny")["status"]["phase"] not in ("Failed", "Succeeded")

        crashed = pods(api, "team-a", "kuberl.io/role=trainer")[0]
        await bind(api, crashed, "node-a")
        await set_pod(api, crashed, "Failed", exit_code=137)
        await eventually(lambda: api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")["status"].get("restarts")
                         == 1, what="the crash counted")
        job = api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer")
        assert job["status"]["preemptions"] == 4 and condition(job, "GangRestarted")["reason"] == "RankFailed"


async def test_suspend_deletes_pods_and_resume_recreates_them(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"suspend": True}})
        await eventually(lambda: pods(api, "team-a") == [], what="pods deleted")
        await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["phase"] == "Suspended", what="Suspended")
        assert api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")["spec"]["suspend"] is True
        assert len(api.list("", "services", "team-a")) == 2  # resources are kept
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"suspend": False}})
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods recreated")
        await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["phase"] == "Pending", what="Pending")


async def test_scaling_replicas_adds_and_removes_pods(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a", "kuberl.io/role=inference")) == 1, what="1 replica")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"inference": {"replicas": 3}}})
        await eventually(lambda: len(pods(api, "team-a", "kuberl.io/role=inference")) == 3, what="3 replicas")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"inference": {"replicas": 2}}})
        await eventually(lambda: sorted(p["metadata"]["name"] for p in pods(api, "team-a", "kuberl.io/role=inference"))
                         == ["cpu-tiny-inference-r0-h0", "cpu-tiny-inference-r1-h0"], what="2 replicas")


async def test_deleting_the_experiment_removes_everything(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        await api.delete(GROUP, "rlexperiments", "team-a", "cpu-tiny")
        await eventually(lambda: not pods(api, "team-a") and not api.list("", "services", "team-a")
                         and not api.list(GROUP, "inferencepools", "team-a"), what="garbage collection")
        assert api.list("", "configmaps", "team-a") == []


async def test_invalid_spec_creates_nothing_and_names_the_field(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        doc = experiment()
        doc["spec"]["allocation"] = "torch:d2+fsdp:d1"
        doc["spec"]["inference"]["tensorParallel"] = 2
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        exp = await eventually(lambda: condition(get_rlx(api, "cpu-tiny"), "SpecValid") and get_rlx(api, "cpu-tiny"),
                               what="SpecValid condition")
        cond = condition(exp, "SpecValid")
        assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert "spec.inference.tensorParallel" in cond["message"]
        assert exp["status"]["phase"] == "Failed"
        assert api.list(GROUP, "inferencepools", "team-a") == [] and pods(api, "team-a") == []


async def test_a_pool_of_a_million_pods_is_refused_naming_the_field_and_others_are_served(tmp_path):
    """The emulator stores what a real API server's CRD rules would refuse: the operator itself must
    refuse a standalone pool of 1,024 × 1,000 pods before it builds a single one, and go on serving."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        huge = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferencePool", "metadata": {"name": "huge"},
                "spec": {"engine": "torch", "replicas": 1024, "hostsPerReplica": 1000}}
        await api.create(GROUP, "inferencepools", "team-a", huge)
        refused = await eventually(lambda: condition(api.get(GROUP, "inferencepools", "team-a", "huge"), "SpecValid"),
                                   what="SpecValid condition on the pool")
        assert refused["status"] == "False" and "hostsPerReplica" in refused["message"]
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="the next experiment's pods")
        assert not pods(api, "team-a", "kuberl.io/inference-pool=huge")


async def test_a_pool_naming_another_experiment_gets_nothing_of_it(tmp_path):
    """spec.experiment is not a key to someone else's experiment: a pool that names a running
    experiment — with no owner, or with a copy of the victim's own owner reference — is refused
    (SpecValid=False naming the field) and gets no pod, so none of the victim's label, network
    admission or API token Secret; the victim's own pool keeps running."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="the victim's pods")
        own = api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")
        thief = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferencePool",
                 "metadata": {"name": "thief", "ownerReferences": own["metadata"]["ownerReferences"]},
                 "spec": {**own["spec"], "image": "attacker/image:latest"}}
        await api.create(GROUP, "inferencepools", "team-a", thief)
        bare = {**thief, "metadata": {"name": "bare-thief"}}
        await api.create(GROUP, "inferencepools", "team-a", bare)
        for name in ("thief", "bare-thief"):
            refused = await eventually(lambda n=name: condition(api.get(GROUP, "inferencepools", "team-a", n),
                                                                "SpecValid"), what=f"SpecValid on {name}")
            assert refused["status"] == "False" and "spec.experiment" in refused["message"]
            assert not pods(api, "team-a", f"kuberl.io/inference-pool={name}")
        assert len(pods(api, "team-a")) == 2
        assert condition(api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference"), "SpecValid") is None


async def test_operator_restart_creates_no_duplicates(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        async with running_operator(cluster):
            await api.create(GROUP, "rlexperiments", "team-a", experiment())
            await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(api, "team-a")}
        pool_uid = api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")["metadata"]["uid"]
        # A pod disappears while the operator is down: the restarted operator replaces only that one.
        await api.delete("", "pods", "team-a", "cpu-tiny-inference-r0-h0")
        async with running_operator(cluster):
            after = await eventually(lambda: len(pods(api, "team-a")) == 2
                                     and {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(api, "team-a")},
                                     what="pod replaced")
        assert set(after) == set(before)
        assert after["cpu-tiny-trainer-n0"] == before["cpu-tiny-trainer-n0"]
        assert api.get(GROUP, "inferencepools", "team-a", "cpu-tiny-inference")["metadata"]["uid"] == pool_uid
        assert len(api.list(GROUP, "inferencepools", "team-a")) == 1
        assert len(api.list("", "services", "team-a")) == 2


async def test_scheduled_pods_get_node_topology_labels(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create("", "nodes", None, {"metadata": {"name": "gpu-node-7", "labels": {
            "topology.kubernetes.io/zone": "eu-west-1a", "nvidia.com/gpu.clique": "cluster-1.3"}}})
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        pod = pods(api, "team-a", "kuberl.io/role=trainer")[0]
        await bind(api, pod, "gpu-node-7")
        name = pod["metadata"]["name"]

        def labelled():
            labels = api.get("", "pods", "team-a", name)["metadata"]["labels"]
            return labels.get("kuberl.io/node") and labels

        labels = await eventually(labelled, what="topology labels")
        assert labels["kuberl.io/node"] == "gpu-node-7"
        assert labels["kuberl.io/zone"] == "eu-west-1a"
        assert labels["kuberl.io/fabric"] == "cluster-1.3"
        assert labels["kuberl.io/rank"] == "0"


def test_example_fixture_is_not_mutated():
    a = experiment()
    b = copy.deepcopy(a)
    a["spec"]["suspend"] = True
    assert "suspend" not in b["spec"]


@contextlib.asynccontextmanager
async def trainer_progress(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A real rank-0 progress endpoint (``kuberl.trainer.progress.ProgressServer``) on the loopback,
    which the operator is told to poll every 0.2 s."""
    import socket

    from kuberl.api import Progress
    from kuberl.trainer.progress import ProgressServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ProgressServer(Progress(max_steps=100, phase="running"))
    runner = await server.start(port)
    monkeypatch.setenv("KUBERL_PROGRESS_URL", f"http://127.0.0.1:{port}/progress?experiment={{name}}")
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "0.2")
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_trainer_progress_reaches_the_experiment_status(tmp_path, monkeypatch):
    """The operator polls rank 0's real progress endpoint and writes status.progress (kubectl's columns); a
    weight push that fell back reaches it and becomes one Warning Event."""
    import asyncio

    from kuberl.api.progress import PoolReceipt, WeightPush

    async with trainer_progress(monkeypatch) as server, emulated_cluster(tmp_path) as cluster, \
            running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        await asyncio.sleep(0.5)
        assert "progress" not in get_rlx(api, "cpu-tiny").get("status", {})  # only Running ones are polled
        for pod in pods(api, "team-a"):
            await bind(api, pod, "node-a")
            await set_pod(api, pod, "Running", ready=True)
        for step, reward in ((3, 0.25), (7, 0.5)):
            server.update(step=step, version=step, reward=reward, observed_staleness=2)
            await eventually(lambda s=step: get_rlx(api, "cpu-tiny")["status"].get("progress", {}).get("step") == s,
                             what=f"progress step {step}")
        assert get_rlx(api, "cpu-tiny")["status"]["progress"] == {
            "step": 7, "version": 7, "reward": 0.5, "observedStaleness": 2, "maxSteps": 100, "phase": "running"}
        assert get_rlx(api, "cpu-tiny")["status"]["phase"] == "Running"  # the experiment's sync keeps it
        # a push that fell back to broadcast: in status.progress.lastPush, and a Warning Event says so once
        fell = WeightPush.of(8, "broadcast", 1000, PoolReceipt(served={"http://r0:8000": 0.25}), "the group broke")
        server.update(step=8, version=8, last_push=fell, pushes_fell_back=1, pushes_slow_replica=0)
        await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["progress"].get("lastPush", {}).get("version")
                         == 8, what="lastPush")
        warnings = await eventually(lambda: [e for e in api.list("", "events", "team-a")
                                             if e["reason"] == "WeightSyncFellBack"], what="the Event")
        assert warnings[0]["type"] == "Warning" and "the group broke" in warnings[0]["message"]
        server.update(step=9, version=9)  # progress moves on, nothing new fell back: no second Event
        await eventually(lambda: get_rlx(api, "cpu-tiny")["status"]["progress"]["step"] == 9, what="step 9")
        assert len([e for e in api.list("", "events", "team-a") if e["reason"] == "WeightSyncFellBack"]) == 1


async def test_objects_it_did_not_create_are_never_adopted_changed_or_pruned(tmp_path):
    """A user's ConfigMap that happens to be named <exp>-config stays as it was, and the experiment
    says which name is taken; a user's pod carrying our labels is neither pruned nor restarted."""
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        mine = await api.create("", "configmaps", "team-a", {"metadata": {"name": "cpu-tiny-config"},
                                                             "data": {"note": "the user's own"}})
        await api.create(GROUP, "rlexperiments", "team-a", experiment())
        exp = await eventually(lambda: condition(get_rlx(api, "cpu-tiny"), "Degraded") and get_rlx(api, "cpu-tiny"),
                               what="a condition")
        degraded = condition(exp, "Degraded")
        assert degraded["reason"] == "ChildNameTaken" and "cpu-tiny-config" in degraded["message"]
        assert api.get("", "configmaps", "team-a", "cpu-tiny-config")["data"] == mine["data"]
        assert api.list(GROUP, "inferencepools", "team-a") == []  # nothing half-created
        await api.delete("", "configmaps", "team-a", "cpu-tiny-config")
        stray = {"metadata": {"name": "someone-elses", "labels": {"kuberl.io/trainer-job": "cpu-tiny-trainer",
                 "kuberl.io/role": "trainer"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}  # fmt: skip
        await api.create("", "pods", "team-a", stray)
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"metadata": {"labels": {"touch": "1"}}})
        await eventually(lambda: len(pods(api, "team-a", "kuberl.io/role=trainer")) == 2, what="our trainer pod")
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny", {"spec": {"suspend": True}})
        await eventually(lambda: [p["metadata"]["name"] for p in pods(api, "team-a", "kuberl.io/role=trainer")]
                         == ["someone-elses"], what="only the stray pod left after suspend")
