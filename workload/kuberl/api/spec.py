"""The user-facing spec of an RLExperiment and the pod-pool sections shared with its children.

Defaults declared here become the CRD schema's defaults (the API server applies them), so the
operator never has to write ``spec``. Sizes that an ``allocation`` string can imply are left
without a default (``None``); ``kuberl.api.resolve`` computes their effective values.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from .agent import AgentSpec
from .algorithm import AlgorithmSpec
from .base import DNS1123_SUBDOMAIN, ApiModel, Positive, SecretKeyRef, cel
from .contract import TrainerRuntime
from .lora import LoraSpec
from .observability import ObservabilitySpec
from .pods import ABSOLUTE_PATH, ImageRef, LabelKey, LabelValue, ResourceRequirements, Toleration
from .rollout import RolloutSpec
from .sources import HUB_REVISION_PATTERN, ChatTemplateSpec, DatasetSource, ExportSpec, RewardSpec
from .tracking import LoggingSpec


class Accelerator(StrEnum):
    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CPU = "cpu"


class Engine(StrEnum):
    VLLM = "vllm"
    TORCH = "torch"


class Backend(StrEnum):
    FSDP = "fsdp"
    MEGATRON = "megatron"


class WeightSyncMode(StrEnum):
    P2P = "p2p"
    BROADCAST = "broadcast"
    DISK = "disk"


class GangScheduler(StrEnum):
    NONE = "none"
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"


class ModelDtype(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


# Upper bounds: one object must not make the operator build an unbounded number of pods in memory.
MAX_PODS = 1024
MAX_DEVICES_PER_NODE = 64


ALLOCATION_PATTERN = (
    r"^(vllm|torch):([dtp][0-9]+)+\+((fsdp|megatron):)?"
    r"(([dtpce][0-9]+)+|\(attn:([dtpc][0-9]+)+\|ffn:([dtpe][0-9]+)+\))$"
)


class SftWarmup(ApiModel):
    """A short supervised warm start on the task's prompt → answer pairs before RL begins."""

    steps: int = Field(0, ge=0, description="0 disables the warm start")
    learning_rate: float = Field(1.0e-3, gt=0, description="AdamW learning rate of the warm start")
    batch_size: Positive = Field(64, description="prompt → answer pairs per warm-start step")


HUB_PREFIX = "hf://"
MODEL_PATH_PATTERN = (r"^(builtin:[a-z0-9-]+|file://.+|s3://.+|hf://[A-Za-z0-9][\w.-]*/[\w.-]+"
                      rf"(@{HUB_REVISION_PATTERN})?|/.+)$")


class ModelSource(ApiModel):
    """The policy: its weights and tokenizer, the dtype it computes in, an optional supervised warm start and how
    prompts are rendered (chat template). It cannot change in a running experiment."""

    model_config = ApiModel.model_config | {
        # a transition rule (the API server checks it on update): the run's checkpoints hold this model
        "json_schema_extra": cel(("self.path == oldSelf.path", "model.path cannot change in a running experiment "
                                  "(its checkpoints hold this model); create a new RLExperiment"))
    }
    path: str = Field(min_length=1, max_length=1024, json_schema_extra={"pattern": MODEL_PATH_PATTERN},
                      description="builtin:tiny-qwen2 (also tiny-qwen2-chat, tiny-qwen3-moe, tiny-qwen2-arithmetic), "
                                  "file:///dir (from_pretrained), s3://prefix/ or hf://ORG/NAME[@REVISION] (the "
                                  "Hugging Face hub)")
    tokenizer: str | None = Field(None, max_length=1024, json_schema_extra={"pattern": MODEL_PATH_PATTERN},
                                  description="tokenizer location (as path); defaults to the model path")
    dtype: ModelDtype = Field(
        ModelDtype.AUTO,
        description="compute dtype of the trainer (FSDP2 mixed precision: forward/backward in this dtype, "
                    "float32 master weights and gradient reduction) and of the inference engines; auto = "
                    "bfloat16 on nvidia/ascend, float32 on cpu",
    )
    sft_warmup: SftWarmup = Field(default_factory=SftWarmup)
    chat_template: ChatTemplateSpec = Field(default_factory=ChatTemplateSpec)
    init_from: str | None = Field(
        None, max_length=1024, json_schema_extra={"pattern": MODEL_PATH_PATTERN},
        description="start from these weights instead of model.path's: a Hugging Face directory, e.g. another "
                    "run's export (<checkpoint uri>hf/step-N/; file://, s3:// or hf://), or another run's FSDP2 "
                    "checkpoint (<checkpoint uri>step-N/). Weights only: optimizer, step and data start fresh; the "
                    "run's own checkpoints win on resume")

    @field_validator("path", "tokenizer", "init_from")
    @classmethod
    def _known_location(cls, uri: str | None) -> str | None:
        if uri is not None and uri.startswith(HUB_PREFIX) and ".." in uri.partition("@")[2]:
            raise ValueError(f"{uri!r}: a hub revision may not hold '..' (a branch, tag or commit: "
                             f"hf://ORG/NAME@REVISION)")
        if uri is not None and not re.match(MODEL_PATH_PATTERN, uri):
            hub_id = re.match(r"^[\w.-]+/[\w.-]+$", uri)
            hint = f"; a Hugging Face hub model is written {HUB_PREFIX}{uri}" if hub_id else ""
            raise ValueError(f"{uri!r} is not a model location: builtin:NAME, file:///dir, s3://bucket/prefix/ or "
                             f"hf://ORG/NAME[@REVISION]{hint}")
        return uri

    @field_validator("init_from")
    @classmethod
    def _weights_on_disk(cls, uri: str | None) -> str | None:
        if uri is not None and uri.startswith("builtin:"):
            raise ValueError(f"{uri!r}: a builtin model has no weights to start from; name a Hugging Face directory")
        return uri


class EvaluationSpec(ApiModel):
    """Held-out evaluation during training (``kuberl.rollout.evaluation``): never trained on."""

    dataset: DatasetSource | None = Field(
        None, description="the evaluation prompts; default: spec.dataset's stream under another seed")
    every_steps: Positive = Field(50, description="evaluate after every N training steps (and after the last)")
    prompts: int = Field(64, ge=1, le=10000, description="the first N examples of the evaluation set")
    samples_per_prompt: int = Field(4, ge=1, le=64, description="k of pass@k")
    temperature: float | None = Field(None, ge=0, description="default: spec.rollout.temperature")
    max_new_tokens: int | None = Field(None, ge=1, description="default: spec.rollout.maxNewTokens")
    reward: RewardSpec | None = Field(None, description="default: spec.reward")


class PodPlacement(ApiModel):
    """Where and how a pool's pods run; shared by the inference and trainer sections."""

    accelerator: Accelerator = Field(Accelerator.NVIDIA, description="the device the pods get: nvidia "
                                                                     "(nvidia.com/gpu), ascend (huawei.com/Ascend910) "
                                                                     "or cpu; picks the default image and engine")
    image: ImageRef | None = Field(None, description="defaults to the operator's image for the accelerator")
    resources: ResourceRequirements | None = Field(None, description="each pod's requests and limits (the device count "
                                                                     "comes from acceleratorsPerNode)")
    node_selector: dict[LabelKey, LabelValue] | None = Field(
        None, max_length=32, description="node labels the pods must match (e.g. a GPU product or node pool)")
    tolerations: list[Toleration] | None = Field(None, max_length=32, description="taints the pods tolerate (e.g. a "
                                                                                  "dedicated accelerator pool's)")


class AutoscaleSpec(ApiModel):
    """The operator (or ``kuberl run``) sizes the pool to keep the trainer's wait for rollouts
    (``status.progress.rolloutWaitFraction``: the share of the last 10 steps' seconds spent waiting) near
    a target: above it one more replica, below half of it one fewer, at most one change per window,
    within [min, max] (``kuberl.api.autoscale``)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(("self.maxReplicas >= self.minReplicas",
                                  "autoscale.maxReplicas must be >= autoscale.minReplicas"))
    }
    min_replicas: int = Field(1, ge=1, le=MAX_PODS, description="the fewest replicas it scales down to")
    max_replicas: int = Field(ge=1, le=MAX_PODS, description="the most replicas it scales up to")
    target_wait_fraction: float = Field(
        0.1, gt=0, lt=1, description="the share of each training step the trainer may wait for rollouts: above it "
                                     "the pool grows by one replica, below half of it shrinks by one")
    window_seconds: int = Field(300, ge=10, le=86400, description="at most one change per window: a new replica's "
                                                                  "effect shows before the next decision")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSpec:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscale.maxReplicas ({self.max_replicas}) must be >= autoscale.minReplicas "
                             f"({self.min_replicas})")
        return self


class InferenceSpec(PodPlacement):
    """The inference pool that generates rollouts: engine, replicas, each replica's parallel layout, placement and
    autoscaling."""

    engine: Engine | None = Field(None, description="vllm on accelerators, torch on cpu by default")
    replicas: int | None = Field(None, ge=1, le=MAX_PODS, description=(
        "number of server replicas (default: the allocation's inference d, else 1); what `kubectl scale "
        "rlexperiment` and an HPA change, at run time too"))
    tensor_parallel: int | None = Field(
        None, ge=1, le=MAX_DEVICES_PER_NODE, description="devices each replica splits every layer over; default 1, or "
                                                         "the allocation's")
    pipeline_parallel: int | None = Field(
        None, ge=1, le=MAX_DEVICES_PER_NODE, description="stages each replica splits its layers into; default 1, or "
                                                         "the allocation's")
    accelerators_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES_PER_NODE)] = Field(
        8, description="devices per host; a replica larger than this spans several hosts"
    )
    port: int = Field(8000, ge=1024, le=65535, description="the port each replica serves on (its pool's headless "
                                                           "Service)")
    autoscale: AutoscaleSpec | None = Field(
        None, description="let the operator set replicas from the trainer's wait for rollouts (it writes "
                          "spec.inference.replicas, as kubectl scale does); every change is an Event and "
                          "status.autoscale")


class Parallelism(ApiModel):
    """How the trainer's ranks split the model (backend megatron; fsdp uses data only): unset sizes are derived from
    the device count and the allocation."""

    data: int | None = Field(None, ge=1, description="derived from the device count if unset")
    tensor: int | None = Field(None, ge=1, description="ranks every layer's matrices are split over (tensor "
                                                       "parallelism)")
    pipeline: int | None = Field(None, ge=1, description="stages the layers are split into (pipeline parallelism)")
    context: int | None = Field(None, ge=1, description="split each sequence's positions over this many ranks, "
                                                        "attention gathering keys and values (backend megatron)")
    expert: int | None = Field(None, ge=1, description="ranks a mixture of experts' experts are spread over (expert "
                                                       "parallelism)")
    expert_tensor: int | None = Field(None, ge=1, description="ranks each expert's matrices are split over (default: "
                                                              "tensor)")


DEFAULT_BACKOFF_LIMIT = 3  # gang restarts before a TrainerJob fails, unless trainer.backoffLimit says


def restart_limit(backoff_limit: int | None) -> int:
    """``trainer.backoffLimit`` as the native and kubeflow runtimes apply it (unset: the default)."""
    return DEFAULT_BACKOFF_LIMIT if backoff_limit is None else backoff_limit


class TrainerSpec(PodPlacement):
    """The trainer gang: backend, runtime, nodes and devices, parallel layout, memory savers, LoRA, restarts."""

    backend: Backend | None = Field(None, description="fsdp unless the allocation says otherwise")
    runtime: TrainerRuntime = Field(
        TrainerRuntime.NATIVE,
        description="who makes the trainer pods: native (the operator), kubeflow (a kubeflow.org/v1 PyTorchJob) or "
                    "trainjob (a Kubeflow Trainer v2 TrainJob on the chart's ClusterTrainingRuntime kuberl-torch)")
    nodes: int | None = Field(None, ge=1, le=MAX_PODS, description="pods; derived from the allocation if unset")
    accelerators_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES_PER_NODE)] = Field(
        8, description="devices per pod; for accelerator cpu, trainer processes per pod"
    )
    parallelism: Parallelism = Field(default_factory=Parallelism, description="tensor, pipeline, context and expert "
                                                                              "parallel sizes (backend megatron)")
    backoff_limit: int | None = Field(
        None, ge=0, description=f"gang restarts before the job fails (default {DEFAULT_BACKOFF_LIMIT}); runtime "
                                "trainjob: the ClusterTrainingRuntime's failurePolicy decides, leave it unset")
    activation_checkpointing: bool = Field(
        False, description="recompute each transformer block's activations in the backward pass instead of keeping "
                           "them: less device memory for long sequences, one more forward per block (backend fsdp)")
    packing: bool = Field(
        False, description="pack each micro-batch's sequences end to end (position ids restart per sequence, "
                           "attention within each) instead of padding rows to the longest: the same loss and "
                           "gradients from fewer tokens of compute on ragged batches")
    step_timeout_seconds: int = Field(
        1800, ge=30, le=86400,
        description="a rank whose training step has not finished after this long (a hung collective) exits "
                    "non-zero so the gang restarts; the collective backends' timeouts are set to match")
    distributed_optimizer: bool = Field(
        False, description="shard AdamW's state over the data-parallel ranks (ZeRO-1: each rank keeps the moments of "
                           "its share of the parameters; backend megatron, whose ranks otherwise each keep them whole; "
                           "FSDP2 already shards them with the weights)")
    lora: LoraSpec | None = Field(None, description="train a low-rank adapter (LoRA) on the frozen policy instead of "
                                                    "the whole model; only the adapter is checkpointed and sent to "
                                                    "the replicas (backend fsdp, engine torch)")


class WeightSyncSpec(ApiModel):
    """How each new policy version reaches the inference replicas."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(("!(has(self.relay) && self.relay) || !has(self.mode) || self.mode == 'p2p'",
                                  "weightSync.relay needs weightSync.mode p2p"))
    }

    mode: WeightSyncMode = Field(WeightSyncMode.P2P, description="p2p: each trainer rank sends its own shards to the "
                                                                 "replicas over planned links (topology-aware); "
                                                                 "broadcast: rank 0 gathers and sends the whole policy "
                                                                 "(the baseline); disk: through a shared directory")
    directory: str | None = Field(
        None, pattern=ABSOLUTE_PATH, max_length=256,
        description="mode disk on a cluster: a directory on a ReadWriteMany volume of spec.storage.volumes "
                    "that the trainer writes and every inference pod reads",
    )
    relay: bool = Field(
        False, description="mode p2p: let the planner send each piece to one replica that forwards it to the "
                           "others, where that is predicted at least 10 % faster (more replicas than the trainer "
                           "has links). A replica that fails during an exchange then costs that version on the "
                           "replicas it feeds, which get it by broadcast, instead of on itself alone")
    timeout_seconds: float = Field(
        600.0, gt=0, le=86400,
        description="the longest one weight exchange may take: a replica that has not taken the version by then "
                    "leaves rotation (named in the log, status.progress.lastPush and an Event; it gets the newest "
                    "weights when it is back) and the exchange goes on without it. Size it for the whole policy "
                    "over the slowest link: 600 s is ≈ 70 GB at 1 Gb/s")

    @model_validator(mode="after")
    def _relay_needs_p2p(self) -> WeightSyncSpec:
        if self.relay and self.mode != WeightSyncMode.P2P:
            raise ValueError(f"weightSync.relay needs weightSync.mode p2p (mode is {self.mode})")
        return self


class VolumeMount(ApiModel):
    """A PersistentVolumeClaim mounted into every workload pod (trainer and inference)."""

    claim_name: str = Field(pattern=DNS1123_SUBDOMAIN, max_length=253,
                            description="PersistentVolumeClaim in the experiment's namespace; ReadWriteMany when "
                                        "pods on several nodes share it")  # fmt: skip
    mount_path: str = Field(pattern=ABSOLUTE_PATH, max_length=256, description="where the pods see it")
    read_only: bool = Field(False, description="mount it read-only (a dataset or model nobody writes)")


class StorageSpec(ApiModel):
    """How workload pods reach storage: S3-compatible stores for every s3:// URI of the experiment
    (model, dataset, checkpoints), and volumes for file:// URIs."""

    credentials_secret: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally AWS_SESSION_TOKEN), "
                    "handed to the pods only as secretKeyRef env",
    )
    endpoint: str | None = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=512,
                                 description="S3-compatible endpoint (MinIO, Ceph RGW, Huawei OBS); AWS if unset")
    region: str | None = Field(None, pattern=r"^[a-z0-9-]+$", max_length=64,
                               description="the S3 region (AWS_REGION); the SDK's default if unset")
    service_account_name: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="ServiceAccount of the workload pods, for workload identity (IRSA, GKE/AKS workload identity) "
                    "instead of a credentials Secret; the pods may then reach the node's metadata address, where "
                    "GKE serves their credentials, if the platform admin allows it (the chart's "
                    "workloadNetworkPolicy.allowMetadataEgress; otherwise the NetworkPolicy blocks it)",
    )
    volumes: list[VolumeMount] = Field(default_factory=list, max_length=8,
                                       description="claims mounted into every workload pod, for file:// URIs")
    hub_token_secret: SecretKeyRef | None = Field(
        None, description="hf:// models and datasets: a Secret key holding a Hugging Face token (gated or private "
                          "repositories), given to the pods as HF_TOKEN by secretKeyRef only")
    hub_endpoint: str | None = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=512,
                                     description="hf:// models and datasets: a hub mirror (HF_ENDPOINT); "
                                                 "huggingface.co if unset")
    allow_insecure_endpoint: bool = Field(
        False, description="let credentials travel to http:// endpoints (storage.endpoint, hubEndpoint, "
                           "logging.wandb.baseUrl, logging.mlflow.trackingUri), e.g. an in-cluster MinIO without "
                           "TLS; refused otherwise, since anyone on the path reads them")


class CheckpointSpec(ApiModel):
    """Where and how often the run saves itself (weights, optimizer, data position, prompt ledger) to resume after a
    failure."""

    uri: str | None = Field(
        None, pattern=r"^(s3|file)://.+", description="s3://bucket/prefix/ or file:///path"
    )
    every_steps: Positive = Field(50, description="save a checkpoint after every N training steps (and the last)")
    keep: int = Field(3, ge=2, le=1000, description="complete checkpoints kept (≥ 2: a restore that fails "
                      "verification falls back to the previous one)")
    credentials_secret: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="same as spec.storage.credentialsSecret (kept for older manifests): the Secret serves every "
                    "s3:// URI of the experiment",
    )


class SchedulingSpec(ApiModel):
    """How the experiment's pods are admitted: one gang (Kueue, Volcano or coscheduling), a priority."""

    queue: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="gang volcano: the Volcano Queue of the experiment's PodGroup; otherwise the Kueue LocalQueue, "
                    "which admits the experiment's pods as one pod group (never both)")
    gang: GangScheduler = Field(GangScheduler.NONE, description="a gang scheduler that places every pod of the "
                                                                "experiment together or none: volcano (a PodGroup; "
                                                                "with queue, its Volcano Queue) or coscheduling (the "
                                                                "scheduler-plugins PodGroup); none: none, or Kueue "
                                                                "when queue is set")
    priority_class_name: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="the PriorityClass of every pod (preemption order among tenants)")

    @property
    def kueue_queue(self) -> str | None:
        """The Kueue LocalQueue the pods go through, if any (``queue`` unless it is Volcano's)."""
        return self.queue if GangScheduler(self.gang) != GangScheduler.VOLCANO else None


def kueue_cel(obj: str) -> str:
    """CEL: ``obj`` (an object with ``scheduling``) sends its pods through a Kueue LocalQueue
    (:attr:`SchedulingSpec.kueue_queue`)."""
    return (f"(has({obj}.scheduling) && has({obj}.scheduling.queue) && "
            f"!(has({obj}.scheduling.gang) && {obj}.scheduling.gang == 'volcano'))")


KUEUE_FIXED_SIZE = ("Kueue admits a pod group at one size (every pod carries the group's total count) and deletes "
                    "pods past it or evicts the whole group")


def trainjob_problems(scheduling: SchedulingSpec, backoff_limit: int | None,
                      whole_experiment: bool) -> list[tuple[str, str]]:
    """(field, why) for each setting a Kubeflow Trainer TrainJob cannot carry (``trainer.runtime:
    trainjob``) — ``scheduling.gang``, ``scheduling.queue`` (of a whole experiment),
    ``scheduling.priorityClassName``, ``backoffLimit`` —: its pods come from JobSet, shaped by the
    ClusterTrainingRuntime and the few pod fields a TrainJob's runtimePatches may set, and restarted
    by the runtime's failure policy."""
    problems = []
    if GangScheduler(scheduling.gang) != GangScheduler.NONE:
        problems.append(("scheduling.gang", f"is {scheduling.gang}: a TrainJob's pods are made by JobSet, and "
                         "Kubeflow Trainer gangs them through the ClusterTrainingRuntime's podGroupPolicy; set it "
                         "there and leave gang none, or use trainer.runtime native"))
    if whole_experiment and scheduling.queue:
        problems.append(("scheduling.queue", f"is {scheduling.queue!r}: a TrainJob is its own Kueue workload, so "
                         "the experiment would be admitted as two units (pool pods, TrainJob) that can deadlock "
                         "half-admitted; use trainer.runtime native (one Kueue pod group per experiment)"))
    if scheduling.priority_class_name:
        problems.append(("scheduling.priorityClassName", "a TrainJob's runtimePatches cannot set a pod's priority "
                         "class; set it on the ClusterTrainingRuntime (or use a Kueue WorkloadPriorityClass)"))
    if backoff_limit is not None:
        problems.append(("backoffLimit", "is set, but a TrainJob's restarts are its ClusterTrainingRuntime's (JobSet "
                         "failurePolicy.maxRestarts; the chart's trainJobRuntime.maxRestarts): leave it unset with "
                         "trainer.runtime trainjob"))
    return problems


def _replicas_cel(obj: str) -> str:
    return f"(has({obj}.inference) && has({obj}.inference.replicas) ? {obj}.inference.replicas : 0)"


class RLExperimentSpec(ApiModel):
    """What to train, on what, how, and where; see README "The manifest"."""

    model_config = ApiModel.model_config | {"json_schema_extra": cel(
        (f"!{kueue_cel('self')} || !has(self.inference) || !has(self.inference.autoscale)",
         f"inference.autoscale cannot be used with a Kueue queue (scheduling.queue): {KUEUE_FIXED_SIZE}, so every "
         "resize would re-queue the experiment; remove autoscale, or use gang volcano"),
        # a transition rule (on update): kubectl scale and spec edits alike
        (f"!{kueue_cel('self')} || (has(oldSelf.suspend) && oldSelf.suspend) || "
         f"{_replicas_cel('self')} == {_replicas_cel('oldSelf')}",
         f"inference.replicas cannot change while an experiment in a Kueue queue runs: {KUEUE_FIXED_SIZE}; set "
         "suspend: true first, then change replicas and resume (the group is admitted again at its new size)"),
    )}

    model: ModelSource
    dataset: DatasetSource
    reward: RewardSpec
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    evaluation: EvaluationSpec | None = None
    agent: AgentSpec | None = Field(None, description="train your own agent through the OpenAI-compatible gateway")
    allocation: str | None = Field(
        None,
        description="AReaL-style shorthand, e.g. 'vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)'",
        # Only in the CRD (the API server rejects garbage early); offline validation parses the
        # string itself and names the exact problem.
        json_schema_extra={"pattern": ALLOCATION_PATTERN, "maxLength": 128},
    )
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="W&B and MLflow, besides TensorBoard")
    observability: ObservabilitySpec | None = Field(
        None, description="OpenTelemetry traces of each sample's life, admission to training (off when unset)")
    storage: StorageSpec = Field(default_factory=StorageSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    suspend: bool = Field(False, description="true: the pods go (the checkpoint stays) until it is false again; the "
                                             "run resumes from its newest checkpoint")
    seed: int = Field(0, description="seeds the model's initialisation, the data order, sampling and the evaluation "
                                     "set")
