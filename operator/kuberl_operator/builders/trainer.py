"""TrainerJob → its gang of rank pods + headless Service, through a runtime seam.

The trainer pod template is built once (``build_trainer_pod``); the runtime decides whether the
templates become Pods (``native``), a Kubeflow PyTorchJob (``kubeflow``) or a Kubeflow Trainer
TrainJob (``trainjob``; both in ``kubeflow``).
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
from ..settings import DEFAULT_BUILD, BuildSettings
from .access import metadata_egress, network_policy
from .common import (
    Manifest,
    container_resources,
    env_list,
    headless_service,
    pod_manifest,
    secret_env,
    tracking_env,
    with_template_hash,
)
from .gang import join_gang, pod_group
from .kubeflow import build_pytorchjob, build_trainjob

TORCHRUN = (
    "torchrun --nnodes=$(NNODES) --nproc-per-node=$(NPROC_PER_NODE) --node-rank=$(NODE_RANK) "
    "--master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)"
)


def job_selector(job: TrainerJob) -> dict[str, str]:
    return {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_TRAINER}


def build_trainer_pod(job: TrainerJob, parent: Manifest, rank: int, token_version: str = "",
                      settings: BuildSettings = DEFAULT_BUILD) -> Manifest:
    """Pod for node rank ``rank``: torchrun with torch-distributed env, one process per device."""
    spec, name = job.spec, job.metadata.name
    accel = profile(spec.accelerator, settings=settings)
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


def build_trainer_children(job: TrainerJob, parent: Manifest, token_version: str = "",
                           settings: BuildSettings = DEFAULT_BUILD) -> list[Manifest]:
    """The NetworkPolicy of a standalone job (an experiment's ranks are under the experiment's), then the
    Service and the job's PodGroup (an experiment's ranks join the experiment's gang), then pods
    (native), one PyTorchJob (kubeflow), or only one TrainJob (trainjob); ``token_version``:
    a standalone job's own token (``common.pod_manifest``)."""
    runtime = TrainerRuntime(job.spec.runtime)
    rank0 = build_trainer_pod(job, parent, 0, token_version, settings)
    policy = [] if job.spec.experiment else [network_policy(
        parent, job.metadata.name, settings.peers, [PROGRESS_PORT],
        metadata=metadata_egress(job.spec.storage, settings), standalone=True)]
    if runtime == TrainerRuntime.TRAINJOB:  # JobSet makes the headless Service <job>; no gang (validated)
        return [*policy, build_trainjob(job, parent, rank0, job_selector(job))]
    out = [*policy, headless_service(parent, job.metadata.name, job_selector(job),
                                     {"dist": MASTER_PORT, "progress": PROGRESS_PORT})]
    group = None if job.spec.gang else pod_group(parent, job.metadata.name, job.spec.nodes, job.spec.scheduling,
                                                 profile(job.spec.accelerator, settings=settings).labels)
    if group:
        out.append(group)
    if runtime == TrainerRuntime.KUBEFLOW:
        return [*out, build_pytorchjob(job, parent, rank0, job_selector(job))]
    pods = [rank0, *(build_trainer_pod(job, parent, rank, token_version, settings)
                     for rank in range(1, job.spec.nodes))]
    return out + ([] if job.spec.suspend else pods)
