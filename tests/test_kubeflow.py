"""The Kubeflow runtimes — ``trainer.runtime: kubeflow`` (a kubeflow.org/v1 PyTorchJob) and ``trainjob``
(a Kubeflow Trainer v2 TrainJob) —: what the builders render, what validate refuses, and the operator
taking each to Succeeded on the emulator, the test playing Kubeflow."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kuberl.api import TrainerJob
from kuberl.api.contract import gateway_service_name
from kuberl_operator.builders.experiment import InvalidSpec
from kuberl_operator.render import render_resource

from .conftest import MINIMAL
from .harness import GROUP, bind, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_builders import by_kind, render, stored
from .test_operator import experiment, get_rlx


def test_kubeflow_runtime_emits_one_pytorchjob_from_the_same_templates():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"nodes": 3, "runtime": "kubeflow"}
    manifests = render(doc)
    jobs = by_kind(manifests, "PyTorchJob")
    assert len(jobs) == 1
    specs = jobs[0]["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    assert jobs[0]["spec"]["nprocPerNode"] == "8"
    for replica in specs.values():
        template = replica["template"]
        (trainer,) = template["spec"]["containers"]
        assert trainer["name"] == "pytorch"  # the container Kubeflow injects its env into
        env = {e["name"] for e in trainer["env"]}
        # Kubeflow injects these (PET_* for torchrun): ours would contradict it; NODE_RANK=1 for every
        # worker was the old template's bug
        assert not env & {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "NNODES",
                          "NPROC_PER_NODE"}, env
        assert "$(" not in trainer["args"][0] and "torchrun -m kuberl.trainer" in trainer["args"][0]
        assert {"name": "pytorchjob-port", "containerPort": 29500} in trainer["ports"]
        assert "kuberl.io/rank" not in template["metadata"]["labels"]
        assert "hostname" not in template["spec"] and "subdomain" not in template["spec"]
    assert not [p for p in by_kind(manifests, "Pod") if p["metadata"]["labels"]["kuberl.io/role"] == "trainer"]


def test_trainjob_runtime_emits_one_trainjob_that_kubeflow_trainers_models_read_back():
    """trainer.runtime trainjob: one Kubeflow Trainer v2 TrainJob on the chart's runtime, no rank pods and no
    headless Service of ours (JobSet makes <job>); the pool and the gateway find rank 0 where JobSet puts it."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"nodes": 3, "runtime": "trainjob"}
    doc["spec"]["agent"] = {"command": ["python", "agent.py"]}
    manifests = render(doc)
    (trainjob,) = by_kind(manifests, "TrainJob")
    parsed = TrainerV1alpha1TrainJob.from_dict(trainjob)  # the SDK's own schema
    assert parsed.spec.runtime_ref.name == "kuberl-torch" and parsed.spec.runtime_ref.kind == "ClusterTrainingRuntime"
    trainer = parsed.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (3, 8)
    assert trainjob["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e.name for e in trainer.env}
    assert not env & {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "NNODES", "NPROC_PER_NODE"}
    assert {"KUBERL_API_TOKEN", "KUBERL_CHECKPOINT_KEY"} <= env
    assert "torchrun -m kuberl.trainer" in trainer.args[0] and "$(" not in trainer.args[0]
    (patch,) = trainjob["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    pod = node["template"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert labels["kuberl.io/role"] == "trainer" and "kuberl.io/rank" not in labels
    assert pod["metadata"]["labels"]["kuberl.io/trainer-job"] == "demo-trainer"
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "node"
    assert any(m["mountPath"] == "/etc/kuberl/config" for m in container["volumeMounts"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {m["name"] for m in container["volumeMounts"]}
    assert not [p for p in by_kind(manifests, "Pod") if p["metadata"]["labels"]["kuberl.io/role"] == "trainer"]
    assert not [s for s in by_kind(manifests, "Service") if s["metadata"]["name"] == "demo-trainer"]
    (pool,) = by_kind(manifests, "InferencePool")
    assert pool["spec"]["trainerAddress"] == "demo-trainer-node-0-0.demo-trainer.team-a.svc"
    (gateway,) = [s for s in by_kind(manifests, "Service") if s["metadata"]["name"] == gateway_service_name("demo")]
    assert gateway["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"


@pytest.mark.parametrize("scheduling, field", [({"gang": "volcano"}, "spec.scheduling.gang"),
                                               ({"queue": "team-a-gpus"}, "spec.scheduling.queue"),
                                               ({"priorityClassName": "high"}, "spec.scheduling.priorityClassName"),
                                               ({}, "spec.trainer.backoffLimit")])
def test_trainjob_runtime_refuses_what_a_trainjob_cannot_carry(scheduling, field):
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"runtime": "trainjob", **({} if scheduling else {"backoffLimit": 3})}
    doc["spec"]["scheduling"] = scheduling
    with pytest.raises(InvalidSpec) as err:
        render(doc)
    assert [i.path for i in err.value.issues] == [field]


def test_standalone_trainjob_goes_to_its_kueue_queue_whole():
    job = TrainerJob.model_validate(stored({"apiVersion": "kuberl.io/v1alpha1", "kind": "TrainerJob",
                                            "metadata": {"name": "t"},
                                            "spec": {"nodes": 2, "runtime": "trainjob",
                                                     "scheduling": {"queue": "team-a-gpus"}}}))
    (trainjob,) = by_kind(render_resource(job), "TrainJob")
    assert trainjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    pod = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert not [k for k in pod["template"]["spec"]["template"]["metadata"]["labels"] if k.startswith("kueue.x-k8s.io")]
    with pytest.raises(ValueError, match=r"scheduling\.gang"):
        TrainerJob.model_validate(stored({"apiVersion": "kuberl.io/v1alpha1", "kind": "TrainerJob",
                                          "metadata": {"name": "t"},
                                          "spec": {"runtime": "trainjob", "scheduling": {"gang": "volcano"}}}))


@pytest.mark.integration
async def test_kubeflow_runtime_reaches_running_and_succeeded_through_the_pytorchjob(tmp_path):
    """trainer.runtime kubeflow: the operator creates a PyTorchJob instead of trainer pods; the test
    plays the Kubeflow training operator (its status conditions, its master pod) and the kubelet."""
    from kuberl.local import apply_overrides

    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", apply_overrides(experiment(), ["trainer.runtime=kubeflow"]))
        (job,) = await eventually(lambda: api.list("kubeflow.org", "pytorchjobs", "team-a"), what="PyTorchJob")
        assert job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
        assert pods(api, "team-a", "kuberl.io/role=trainer") == []  # Kubeflow makes those
        (replica,) = await eventually(lambda: pods(api, "team-a", "kuberl.io/role=inference"), what="replica")
        await bind(api, replica, "node-a")
        await set_pod(api, replica, "Running", ready=True)

        async def kubeflow_says(kind: str, active: int, at: str) -> None:
            await api.patch("kubeflow.org", "pytorchjobs", "team-a", "cpu-tiny-trainer", {"status": {
                "conditions": [{"type": "Created", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                               {"type": kind, "status": "True", "lastTransitionTime": at}],
                "replicaStatuses": {"Master": {"active": active}}}}, subresource="status")  # fmt: skip

        def phase() -> str | None:
            return get_rlx(api, "cpu-tiny").get("status", {}).get("phase")

        await kubeflow_says("Created", 0, "2026-01-01T00:00:00Z")
        await eventually(lambda: api.get(GROUP, "trainerjobs", "team-a", "cpu-tiny-trainer").get("status", {})
                         .get("phase") == "Initializing", what="TrainerJob Initializing")
        assert phase() != "Running"
        await kubeflow_says("Running", 1, "2026-01-01T00:01:00Z")
        await eventually(lambda: phase() == "Running", what="experiment Running")
        master = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu-tiny-trainer-master-0",
                  "labels": job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]},
                  "spec": {"containers": [{"name": "pytorch", "image": "x"}]}}  # fmt: skip
        created = await api.create("", "pods", "team-a", master)
        final = {"exitCode": 0, "message": '{"step": 500, "version": 500, "reward": 0.8}'}
        await api.patch("", "pods", "team-a", created["metadata"]["name"], {"status": {"phase": "Succeeded",
                        "containerStatuses": [{"name": "pytorch", "state": {"terminated": final}}]}},
                        subresource="status")  # fmt: skip
        await kubeflow_says("Succeeded", 0, "2026-01-01T00:09:00Z")
        exp = await eventually(lambda: phase() == "Succeeded" and get_rlx(api, "cpu-tiny"), what="Succeeded")
        assert exp["status"]["progress"]["step"] == 500  # from the master pod's termination message


@pytest.mark.integration
async def test_trainjob_runtime_reaches_running_and_succeeded_through_the_trainjob(tmp_path):
    """trainer.runtime trainjob: the operator creates a Kubeflow Trainer v2 TrainJob instead of trainer pods
    and its headless Service; the test plays Kubeflow Trainer and JobSet (the TrainJob's status, a
    random-named rank-0 pod built from the runtime patch) and the kubelet. The final progress comes from
    that pod, found by its labels."""
    from kuberl.local import apply_overrides

    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create(GROUP, "rlexperiments", "team-a", apply_overrides(experiment(), ["trainer.runtime=trainjob"]))
        (job,) = await eventually(lambda: api.list("trainer.kubeflow.org", "trainjobs", "team-a"), what="TrainJob")
        assert job["spec"]["runtimeRef"]["name"] == "kuberl-torch" and job["spec"]["trainer"]["numNodes"] == 1
        assert pods(api, "team-a", "kuberl.io/role=trainer") == []  # JobSet makes those
        assert not [s for s in api.list("", "services", "team-a") if s["metadata"]["name"] == "cpu-tiny-trainer"]
        (replica,) = await eventually(lambda: pods(api, "team-a", "kuberl.io/role=inference"), what="replica")
        await bind(api, replica, "node-a")
        await set_pod(api, replica, "Running", ready=True)

        async def trainer_says(conditions: list[str], **node: int) -> None:
            await api.patch("trainer.kubeflow.org", "trainjobs", "team-a", "cpu-tiny-trainer", {"status": {
                "conditions": [{"type": t, "status": "True", "reason": t, "message": ""} for t in conditions],
                "jobsStatus": [{"name": "node", **node}]}}, subresource="status")  # fmt: skip

        def phase(kind: str = "rlexperiments", name: str = "cpu-tiny") -> str | None:
            return api.get(GROUP, kind, "team-a", name).get("status", {}).get("phase")

        await trainer_says([], active=1)
        await eventually(lambda: phase("trainerjobs", "cpu-tiny-trainer") == "Initializing", what="Initializing")
        assert phase() != "Running"
        await trainer_says([], active=1, ready=1)
        await eventually(lambda: phase() == "Running", what="experiment Running")
        node = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        labels = {**node["template"]["spec"]["template"]["metadata"]["labels"],
                  "jobset.sigs.k8s.io/jobset-name": "cpu-tiny-trainer", "batch.kubernetes.io/job-completion-index": "0"}
        initializer = {"jobset.sigs.k8s.io/jobset-name": "cpu-tiny-trainer"}  # a runtime's initializer step
        for index, name, pod_labels in ((0, "cpu-tiny-trainer-dataset-initializer-0-0-b4v9c", initializer),
                                        (1, "cpu-tiny-trainer-node-0-1-q8w2z", labels),
                                        (0, "cpu-tiny-trainer-node-0-0-x7k2p", labels)):
            rank = {**pod_labels, "batch.kubernetes.io/job-completion-index": str(index)}
            await api.create("", "pods", "team-a", {"apiVersion": "v1", "kind": "Pod",
                                                    "metadata": {"name": name, "labels": rank},
                                                    "spec": {"containers": [{"name": "node", "image": "x"}]}})
            message = json.dumps({"step": 500 + index + (pod_labels is initializer), "version": 500, "reward": 0.8})
            await api.patch("", "pods", "team-a", name, {"status": {"phase": "Succeeded", "containerStatuses": [
                {"name": "node", "state": {"terminated": {"exitCode": 0, "message": message}}}]}},
                subresource="status")  # fmt: skip
        await trainer_says(["Complete"], succeeded=1)
        exp = await eventually(lambda: phase() == "Succeeded" and get_rlx(api, "cpu-tiny"), what="Succeeded")
        assert exp["status"]["progress"]["step"] == 500  # rank 0's termination message, not another pod's


@pytest.mark.slow
def test_the_operator_loads_no_kubernetes_client_until_it_builds_a_kubeflow_job():
    """kopf imports the ``kubernetes`` package whenever it is installed (47 MiB, here for the Kubeflow
    SDK): the operator's process keeps it out while kopf and the handlers load, and a PyTorchJob built
    later still gets its SDK (and so the client) — the builder is the one that needs it."""
    probe = (
        "import json, sys\n"
        "from kuberl_operator.main import import_handlers\n"
        "import_handlers()\n"
        "loaded = 'kubernetes' in sys.modules\n"
        "from kuberl.api import RLExperiment\n"
        "from kuberl_operator.render import render_resource\n"
        f"doc = json.loads({json.dumps(json.dumps(stored(MINIMAL)))})\n"
        "doc['spec']['trainer'] = {'nodes': 2, 'runtime': 'kubeflow'}\n"
        "kinds = [m['kind'] for m in render_resource(RLExperiment.model_validate(doc))]\n"
        "print(json.dumps([loaded, 'kubernetes' in sys.modules, 'PyTorchJob' in kinds]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, True, True]
