"""The contract between operator and workload (docs/architecture.md, "The contract"): the names,
labels, env variables, paths and ports both sides use. The operator's builders write them into pod
specs; the workload (and ``kuberl run``, which plays the operator's part locally) reads them. Any
name that crosses that line is defined here and nowhere else."""

from __future__ import annotations

from enum import StrEnum

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
ANNOTATION_TEMPLATE_HASH = f"{PREFIX}/template-hash"  # a pod or PyTorchJob whose template changed is replaced
ANNOTATION_CONFIG_REVISION = f"{PREFIX}/config-revision"  # the run config a pod reads at start (its hash)
ANNOTATION_TOKEN_VERSION = f"{PREFIX}/token-version"  # the API token Secret(s) a pod was started with
ROLE_INFERENCE = "inference"
ROLE_TRAINER = "trainer"
ROLE_AGENT = "agent"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kuberl-operator", "app.kubernetes.io/part-of": "kuberl"}

CONFIG_MOUNT = "/etc/kuberl/config"
CONFIG_FILE = "experiment.yaml"
PODINFO_MOUNT = "/etc/kuberl/podinfo"
PODINFO_LABELS = f"{PODINFO_MOUNT}/labels"  # downward API: the pod's own labels, key="value" per line
MASTER_PORT = 29500  # the trainer gang's torch.distributed store; + 1: the p2p weight exchange's
PROGRESS_PORT = 8080  # trainer rank 0's GET /progress (polled by the operator)
INFERENCE_PORT = 8000  # an inference replica's HTTP port when the spec does not say (spec.inference.port)
GATEWAY_PORT = 8090  # trainer rank 0's OpenAI-compatible gateway (spec.agent)
TINKER_PORT = 8100  # the Tinker-compatible API (kuberl serve; kuberl.tinker)
REPLICA_GROUP_PORT = 29400  # where the processes of a replica that spans hosts meet (its leader's pod)
HEADER_SESSION = "X-KubeRL-Session"  # an agent's episode, on each of its gateway calls
HEADER_GROUP = "X-KubeRL-Group"  # the GRPO group an episode belongs to (e.g. the task)
TERMINATION_LOG = "/dev/termination-log"  # rank 0's final progress, read back by the operator

# API token (docs/architecture.md, "Who may call what"): every state-changing endpoint of the
# workload's servers requires ``Authorization: Bearer <token>``; the operator creates one Secret
# per experiment and gives every pod the token through ENV_API_TOKEN (a secretKeyRef).
API_TOKEN_KEY = "token"
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer"

# Environment of the workload's processes, set by the operator's builders (kuberl run sets the same);
# read once per process by kuberl.settings. What only kuberl run varies (its ports, directories, step
# limit) goes into the run config's settings section instead (kuberl.settings.RUN_CONFIG_FIELDS).
ENV_ROLE = "KUBERL_ROLE"  # inference | trainer
ENV_REPLICA = "KUBERL_REPLICA"  # inference replica index
ENV_REPLICA_HOST = "KUBERL_REPLICA_HOST"  # this process's rank within a replica that spans hosts (0: its leader)
ENV_REPLICA_HOSTS = "KUBERL_REPLICA_HOSTS"  # how many hosts (processes) the replica spans
ENV_REPLICA_LEADER = "KUBERL_REPLICA_LEADER"  # host:port where the replica's processes meet (its leader's)
ENV_PORT = "KUBERL_PORT"  # inference server port
ENV_API_TOKEN = "KUBERL_API_TOKEN"
ENV_CHECKPOINT_KEY = "KUBERL_CHECKPOINT_KEY"  # trainer pods: signs and checks checkpoint manifests
ENV_AGENT_TOKEN = "KUBERL_AGENT_TOKEN"  # the gateway's: the only token an agent holds (spec.agent)
ENV_HUB_TOKEN = "HF_TOKEN"  # spec.storage.hubTokenSecret, by secretKeyRef: gated or private hf:// models
ENV_HUB_ENDPOINT = "HF_ENDPOINT"  # spec.storage.hubEndpoint: a hub mirror
ENV_WANDB_API_KEY = "WANDB_API_KEY"  # spec.logging.wandb.apiKeySecret, by secretKeyRef (read by wandb itself)
ENV_WANDB_BASE_URL = "WANDB_BASE_URL"  # spec.logging.wandb.baseUrl
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",  # spec.logging.mlflow.credentialsSecret's
                      "MLFLOW_TRACKING_PASSWORD")  # keys, each optional, by secretKeyRef (read by mlflow itself)
ENV_INFERENCE_SERVICE = "KUBERL_INFERENCE_SERVICE"  # the pool's headless Service (trainer side)
ENV_TERMINATION_LOG = "KUBERL_TERMINATION_LOG"
ENV_EXCHANGE_ADDR = "KUBERL_EXCHANGE_ADDR"
ENV_EXCHANGE_PORT = "KUBERL_EXCHANGE_PORT"
ENV_PODINFO_LABELS = "KUBERL_PODINFO_LABELS"  # overrides PODINFO_LABELS (local mode)
ENV_THREADS = "KUBERL_THREADS"
ENV_S3_ENDPOINT = "KUBERL_S3_ENDPOINT"
ENV_CACHE_DIR = "KUBERL_CACHE_DIR"
ENV_FAULT_INJECTION = "KUBERL_FAULT_INJECTION"  # "signals": chaos tests' fault door (kuberl.inference.faults)
ENV_OPENAI_BASE_URL = "OPENAI_BASE_URL"  # the agent's: the gateway, read by the OpenAI client libraries
ENV_OPENAI_API_KEY = "OPENAI_API_KEY"  # the agent's: the experiment's API token
# KubeRL's own secrets in a trainer pod's environment: a reward worker (the user's code, scoring
# model-written text) starts without them (kuberl.rewards.pool); the user's own credentials stay.
KUBERL_SECRET_ENV = (ENV_API_TOKEN, ENV_AGENT_TOKEN, ENV_CHECKPOINT_KEY)


def inference_pool_name(experiment: str) -> str:
    return f"{experiment}-inference"


def trainer_job_name(experiment: str) -> str:
    return f"{experiment}-trainer"


def config_map_name(experiment: str) -> str:
    return f"{experiment}-config"


def postmortem_config_map_name(experiment: str) -> str:
    """Where the operator keeps a failed experiment's post-mortem bundle (``kuberl_operator.postmortem``)."""
    return f"{experiment}-postmortem"


POSTMORTEM_ARCHIVE_KEY = "postmortem.tar.gz"  # its key in that ConfigMap's binaryData (kuberl postmortem reads it)


API_TOKEN_SUFFIX = "-api-token"


def api_token_secret_name(experiment: str) -> str:
    return f"{experiment}{API_TOKEN_SUFFIX}"


AGENT_TOKEN_SUFFIX = "-agent-token"
CHECKPOINT_KEY_SUFFIX = "-checkpoint-key"  # the manifests' signing key: never rotated (old checkpoints stay valid)


def checkpoint_key_secret_name(experiment: str) -> str:
    return f"{experiment}{CHECKPOINT_KEY_SUFFIX}"


def agent_token_secret_name(experiment: str) -> str:
    return f"{experiment}{AGENT_TOKEN_SUFFIX}"


def gateway_service_name(experiment: str) -> str:
    return f"{experiment}-gateway"


def agent_deployment_name(experiment: str) -> str:
    return f"{experiment}-agent"


def network_policy_name(experiment: str) -> str:
    return experiment


def inference_pod_name(pool: str, replica: int, host: int) -> str:
    return f"{pool}-r{replica}-h{host}"


def inference_replica_host(pool: str, replica: int) -> str:
    """A replica's DNS name (its first host's pod under the pool's headless Service), relative to the
    namespace: where the trainer sends the replica's requests."""
    return f"{inference_pod_name(pool, replica, 0)}.{pool}"


def trainer_pod_name(job: str, rank: int) -> str:
    return f"{job}-n{rank}"


class TrainerRuntime(StrEnum):
    """Who turns a TrainerJob's pod template into running pods (``spec.trainer.runtime``)."""

    NATIVE = "native"  # the operator: one pod per node rank, ``<job>-n<rank>``
    KUBEFLOW = "kubeflow"  # a kubeflow.org/v1 PyTorchJob (Kubeflow's training operator)
    TRAINJOB = "trainjob"  # a Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime TRAINJOB_RUNTIME


# Kubeflow Trainer v2 (trainer.kubeflow.org): the ClusterTrainingRuntime the chart ships, its replicated
# job and container (a torch runtime's "node"), and the labels JobSet puts on the pods it makes.
TRAINJOB_RUNTIME = "kuberl-torch"
TRAINJOB_NODE = "node"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the node rank of an indexed Job's pod
LABEL_JOBSET = "jobset.sigs.k8s.io/jobset-name"  # = the TrainJob's name


def trainer_rank0_selector(experiment: str, runtime: str = TrainerRuntime.NATIVE) -> dict[str, str]:
    """Labels that select trainer rank 0's pod (the gateway's Service selects it)."""
    rank0 = {TrainerRuntime.KUBEFLOW: {"training.kubeflow.org/replica-type": "master"},
             TrainerRuntime.TRAINJOB: {LABEL_COMPLETION_INDEX: "0"}}.get(TrainerRuntime(runtime), {LABEL_RANK: "0"})
    return {LABEL_EXPERIMENT: experiment, LABEL_ROLE: ROLE_TRAINER, **rank0}


def trainer_rank0_pod(job: str, runtime: str = TrainerRuntime.NATIVE) -> str | None:
    """Trainer rank 0's pod: ours (``<job>-n0``), the PyTorchJob's master (``<job>-master-0``), or None
    for a TrainJob (its Job's pods end in a random suffix: select it by ``trainer_rank0_selector``)."""
    runtime = TrainerRuntime(runtime)
    if runtime == TrainerRuntime.TRAINJOB:
        return None
    return f"{job}-master-0" if runtime == TrainerRuntime.KUBEFLOW else trainer_pod_name(job, 0)


def trainer_rank0_host(job: str, namespace: str | None, runtime: str = TrainerRuntime.NATIVE) -> str:
    """Rank 0's DNS name (relative to the pod's own namespace when ``namespace`` is None: an offline
    render): under our headless Service ``<job>`` (``<job>-n0.<job>``), Kubeflow's per-pod Service
    (``<job>-master-0``), or the TrainJob's JobSet Service (``<job>-node-0-0.<job>``: replicated job
    "node", job 0, completion index 0)."""
    runtime = TrainerRuntime(runtime)
    if runtime == TrainerRuntime.TRAINJOB:
        host = f"{job}-{TRAINJOB_NODE}-0-0.{job}"
    elif runtime == TrainerRuntime.KUBEFLOW:
        host = f"{job}-master-0"
    else:
        host = f"{trainer_pod_name(job, 0)}.{job}"
    return f"{host}.{namespace}.svc" if namespace else host
