"""TrainerJob → its gang of rank pods + headless Service, through a runtime seam.

The trainer pod template is built once (``build_trainer_pod``); the runtime decides whether the
templates become Pods (``native``) or a Kubeflow PyTorchJob (``kubeflow``).
"""

from __future__ import annotations

from kuberl.api import TrainerJob
from kuberl.api.spec import TrainerRuntime

from ..accelerators import profile
from ..names import (
    LABEL_ACCELERATOR,
    LABEL_EXPERIMENT,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_ROLE,
    MASTER_PORT,
    PROGRESS_PORT,
    ROLE_TRAINER,
    trainer_pod_name,
)
from .common import (
    Manifest,
    child_metadata,
    container_resources,
    env_list,
    headless_service,
    pod_manifest,
)
from .gang import join_gang, pod_group

TORCHRUN = (
    "torchrun --nnodes=$(NNODES) --nproc-per-node=$(NPROC_PER_NODE) --node-rank=$(NODE_RANK) "
    "--master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)"
)


def job_selector(job: TrainerJob) -> dict[str, str]:
    return {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_TRAINER}


def master_address(job: TrainerJob) -> str:
    name, ns = job.metadata.name, job.metadata.namespace
    host = f"{trainer_pod_name(name, 0)}.{name}"
    return f"{host}.{ns}.svc" if ns else host


def build_trainer_pod(job: TrainerJob, parent: Manifest, rank: int) -> Manifest:
    """Pod for node rank ``rank``: torchrun with torch-distributed env, one process per device."""
    spec, name = job.spec, job.metadata.name
    accel = profile(spec.accelerator)
    par = spec.parallelism
    env = {
        **accel.env,
        "KUBERL_ROLE": ROLE_TRAINER,
        "KUBERL_BACKEND": str(spec.backend),
        "MASTER_ADDR": master_address(job),
        "MASTER_PORT": str(MASTER_PORT),
        "WORLD_SIZE": str(spec.nodes * spec.procs_per_node),
        "NNODES": str(spec.nodes),
        "NODE_RANK": str(rank),
        "NPROC_PER_NODE": str(spec.procs_per_node),
        "KUBERL_PARALLELISM": ",".join(
            f"{k}={v}" for k, v in par.to_wire().items() if v is not None
        ),
    }
    if spec.inference_service:
        env["KUBERL_INFERENCE_SERVICE"] = spec.inference_service
    container: Manifest = {
        "name": "trainer",
        "command": ["/bin/sh", "-c"],
        "args": [f"exec {TORCHRUN} -m kuberl.trainer --config /etc/kuberl/config/experiment.yaml"],
        "env": env_list(env),
        # Rank 0 leaves its final progress here; on a crash the log tail takes its place, so the
        # error reaches the TrainerJob / RLExperiment conditions (status.pod_health).
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [
            {"name": "dist", "containerPort": MASTER_PORT},
            {"name": "progress", "containerPort": PROGRESS_PORT},
        ],
        "resources": container_resources(spec, accel, spec.procs_per_node),
    }
    labels = {
        LABEL_EXPERIMENT: spec.experiment or name,
        LABEL_ROLE: ROLE_TRAINER,
        LABEL_JOB: name,
        LABEL_RANK: str(rank),
        LABEL_ACCELERATOR: str(spec.accelerator),
    }
    pod = pod_manifest(
        parent, name=trainer_pod_name(name, rank), subdomain=name, labels=labels, placement=spec,
        scheduling=spec.scheduling, accel=accel, container=container,
        config_map=spec.config_map, restart_policy="Never", storage=spec.storage,
    )
    return join_gang(pod, name, spec.scheduling)


def build_pytorchjob(job: TrainerJob, parent: Manifest, pods: list[Manifest]) -> Manifest:
    """Kubeflow runtime: the same pod templates as a kubeflow.org/v1 PyTorchJob (Master + Workers)."""
    def template(pod: Manifest) -> Manifest:
        return {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]}

    specs: Manifest = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template(pods[0])}}
    if len(pods) > 1:
        specs["Worker"] = {"replicas": len(pods) - 1, "restartPolicy": "Never", "template": template(pods[1])}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": child_metadata(parent, job.metadata.name, job_selector(job)),
        "spec": {
            "runPolicy": {"backoffLimit": job.spec.backoff_limit, "suspend": job.spec.suspend},
            "nprocPerNode": str(job.spec.procs_per_node),
            "pytorchReplicaSpecs": specs,
        },
    }


def build_trainer_children(job: TrainerJob, parent: Manifest) -> list[Manifest]:
    """Service, optional PodGroup, then pods (native) or one PyTorchJob (kubeflow)."""
    out = [headless_service(parent, job.metadata.name, job_selector(job),
                            {"dist": MASTER_PORT, "progress": PROGRESS_PORT})]
    group = pod_group(parent, job.metadata.name, job.spec.nodes, job.spec.scheduling)
    if group:
        out.append(group)
    pods = [build_trainer_pod(job, parent, rank) for rank in range(job.spec.nodes)]
    if TrainerRuntime(job.spec.runtime) == TrainerRuntime.KUBEFLOW:
        return [*out, build_pytorchjob(job, parent, pods)]
    return out + ([] if job.spec.suspend else pods)
