"""Names and labels shared by the builders, the handlers and the workload (docs/architecture.md, "The contract")."""

from __future__ import annotations

PREFIX = "kuberl.io"
LABEL_EXPERIMENT = f"{PREFIX}/experiment"
LABEL_ROLE = f"{PREFIX}/role"
LABEL_REPLICA = f"{PREFIX}/replica"
LABEL_HOST = f"{PREFIX}/host"
LABEL_RANK = f"{PREFIX}/rank"
LABEL_POOL = f"{PREFIX}/inference-pool"
LABEL_JOB = f"{PREFIX}/trainer-job"
LABEL_NODE = f"{PREFIX}/node"
LABEL_ZONE = f"{PREFIX}/zone"
LABEL_FABRIC = f"{PREFIX}/fabric"
LABEL_ACCELERATOR = f"{PREFIX}/accelerator"
ANNOTATION_GENERATION = f"{PREFIX}/parent-generation"
ROLE_INFERENCE = "inference"
ROLE_TRAINER = "trainer"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kuberl-operator", "app.kubernetes.io/part-of": "kuberl"}

CONFIG_MOUNT = "/etc/kuberl/config"
CONFIG_FILE = "experiment.yaml"
PODINFO_MOUNT = "/etc/kuberl/podinfo"
MASTER_PORT = 29500
PROGRESS_PORT = 8080


def inference_pool_name(experiment: str) -> str:
    return f"{experiment}-inference"


def trainer_job_name(experiment: str) -> str:
    return f"{experiment}-trainer"


def config_map_name(experiment: str) -> str:
    return f"{experiment}-config"


def inference_pod_name(pool: str, replica: int, host: int) -> str:
    return f"{pool}-r{replica}-h{host}"


def trainer_pod_name(job: str, rank: int) -> str:
    return f"{job}-n{rank}"


def trainer_rank0_pod(job: str, kubeflow: bool = False) -> str:
    """Trainer rank 0's pod: ours (``<job>-n0``) or, with the Kubeflow runtime, the PyTorchJob's master."""
    return f"{job}-master-0" if kubeflow else trainer_pod_name(job, 0)


def trainer_rank0_host(job: str, namespace: str, kubeflow: bool = False) -> str:
    """Rank 0's DNS name: under our headless Service ``<job>``, or Kubeflow's per-pod Service."""
    pod = trainer_rank0_pod(job, kubeflow)
    return f"{pod}.{namespace}.svc" if kubeflow else f"{pod}.{job}.{namespace}.svc"
