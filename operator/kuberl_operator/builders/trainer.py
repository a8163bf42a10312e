"""TrainerJob → its gang of rank pods + headless Service, through a runtime seam.

The trainer pod template is built once (``build_trainer_pod``); the runtime decides whether the
templates become Pods (``native``) or a Kubeflow PyTorchJob (``kubeflow``).
"""

from __future__ import annotations

from kuberl.api import TrainerJob
from kuberl.api.contract import (
    API_TOKEN_KEY,
    CONFIG_FILE,
    CONFIG_MOUNT,
    ENV_AGENT_TOKEN,
    ENV_CHECKPOINT_KEY,
    LABEL_ACCELERATOR,
    LABEL_EXPERIMENT,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_ROLE,
    MASTER_PORT,
    PROGRESS_PORT,
    ROLE_TRAINER,
    TERMINATION_LOG,
    agent_token_secret_name,
    checkpoint_key_secret_name,
    trainer_pod_name,
    trainer_rank0_host,
)
from kuberl.api.roles import trainer_node_env
from kuberl.api.spec import TrainerRuntime

from ..accelerators import profile
from .common import (
    Manifest,
    child_metadata,
    container_resources,
    env_list,
    headless_service,
    pod_manifest,
    secret_env,
    tracking_env,
    with_template_hash,
)
from .gang import join_gang, pod_group

TORCHRUN = (
    "torchrun --nnodes=$(NNODES) --nproc-per-node=$(NPROC_PER_NODE) --node-rank=$(NODE_RANK) "
    "--master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)"
)


def job_selector(job: TrainerJob) -> dict[str, str]:
    return {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_TRAINER}


def build_trainer_pod(job: TrainerJob, parent: Manifest, rank: int, token_version: str = "") -> Manifest:
    """Pod for node rank ``rank``: torchrun with torch-distributed env, one process per device."""
    spec, name = job.spec, job.metadata.name
    accel = profile(spec.accelerator)
    master = (trainer_rank0_host(name, job.metadata.namespace), MASTER_PORT)
    env = {**accel.env, **trainer_node_env(master, spec.nodes, spec.procs_per_node, rank, spec.inference_service)}
    experiment = spec.experiment or name
    agent_token = secret_env(ENV_AGENT_TOKEN, agent_token_secret_name(experiment), API_TOKEN_KEY,
                             optional=True)  # the gateway's (spec.agent only)
    checkpoint_key = secret_env(ENV_CHECKPOINT_KEY, checkpoint_key_secret_name(experiment), API_TOKEN_KEY)
    container: Manifest = {
        "name": "trainer",
        "command": ["/bin/sh", "-c"],
        "args": [f"exec {TORCHRUN} -m kuberl.trainer --config {CONFIG_MOUNT}/{CONFIG_FILE}"],
        "env": [*env_list(env), agent_token, checkpoint_key, *tracking_env(spec.logging)],
        # Rank 0 leaves its final progress here; on a crash the log tail takes its place, so the
        # error reaches the TrainerJob / RLExperiment conditions (status.pod_health).
        "terminationMessagePath": TERMINATION_LOG,
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
        config_revision=spec.config_revision, token_version=token_version,
    )
    group, members = (spec.gang.group, spec.gang.members) if spec.gang else (name, spec.nodes)
    return with_template_hash(join_gang(pod, group, members, spec.scheduling))


# What the Kubeflow training operator injects into the "pytorch" container of a PyTorchJob with
# nprocPerNode (torchrun reads PET_* as defaults for its flags): the native pod's own values would
# contradict it, so the template leaves them out.
KUBEFLOW_INJECTED = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NNODES", "NODE_RANK", "NPROC_PER_NODE"}
KUBEFLOW_CONTAINER, KUBEFLOW_PORT_NAME = "pytorch", "pytorchjob-port"


def kubeflow_template(pod: Manifest) -> Manifest:
    """A native trainer pod → the template every PyTorchJob replica shares: container "pytorch"
    (the one Kubeflow injects into), its dist port named "pytorchjob-port" (Kubeflow's master port),
    torchrun without rendezvous flags (PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
    PET_MASTER_ADDR, PET_MASTER_PORT come from Kubeflow), no per-rank name, hostname or label."""
    spec = {k: v for k, v in pod["spec"].items() if k not in ("hostname", "subdomain")}
    container = dict(spec["containers"][0])
    container["name"] = KUBEFLOW_CONTAINER
    container["env"] = [e for e in container["env"] if e["name"] not in KUBEFLOW_INJECTED]
    container["args"] = [f"exec torchrun -m kuberl.trainer --config {CONFIG_MOUNT}/{CONFIG_FILE}"]
    container["ports"] = [{**p, "name": KUBEFLOW_PORT_NAME} if p["name"] == "dist" else p for p in container["ports"]]
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k != LABEL_RANK}
    return {"metadata": {"labels": labels, **({"annotations": pod["metadata"]["annotations"]}
                                              if pod["metadata"].get("annotations") else {})},
            "spec": {**spec, "containers": [container]}}  # fmt: skip


def build_pytorchjob(job: TrainerJob, parent: Manifest, pod: Manifest) -> Manifest:
    """Kubeflow runtime: the trainer pod template as a kubeflow.org/v1 PyTorchJob, Master (node 0)
    plus nodes − 1 Workers; Kubeflow names the pods ``<job>-master-0`` / ``<job>-worker-N``."""
    template = kubeflow_template(pod)
    specs: Manifest = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if job.spec.nodes > 1:
        specs["Worker"] = {"replicas": job.spec.nodes - 1, "restartPolicy": "Never", "template": template}
    return with_template_hash({
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": child_metadata(parent, job.metadata.name, job_selector(job)),
        "spec": {
            "runPolicy": {"backoffLimit": job.spec.backoff_limit, "suspend": job.spec.suspend,
                          "cleanPodPolicy": "None"},  # rank 0's termination message outlives the job
            "nprocPerNode": str(job.spec.procs_per_node),
            "pytorchReplicaSpecs": specs,
        },
    })


def build_trainer_children(job: TrainerJob, parent: Manifest, token_version: str = "") -> list[Manifest]:
    """Service, the PodGroup of a standalone job (an experiment's ranks join the experiment's), then pods
    (native) or one PyTorchJob (kubeflow); ``token_version``:
    a standalone job's own token (``common.pod_manifest``)."""
    out = [headless_service(parent, job.metadata.name, job_selector(job),
                            {"dist": MASTER_PORT, "progress": PROGRESS_PORT})]
    group = None if job.spec.gang else pod_group(parent, job.metadata.name, job.spec.nodes, job.spec.scheduling,
                                                 profile(job.spec.accelerator).labels)
    if group:
        out.append(group)
    if TrainerRuntime(job.spec.runtime) == TrainerRuntime.KUBEFLOW:
        return [*out, build_pytorchjob(job, parent, build_trainer_pod(job, parent, 0, token_version))]
    pods = [build_trainer_pod(job, parent, rank, token_version) for rank in range(job.spec.nodes)]
    return out + ([] if job.spec.suspend else pods)
