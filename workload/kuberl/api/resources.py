"""The three custom resources: RLExperiment, InferencePool and TrainerJob (kuberl.io/v1alpha1).

Status follows the KubeRay / metav1 convention: ``phase`` + ``conditions`` + ``observedGeneration``.
InferencePool and TrainerJob specs hold *resolved* sizes (no allocation string): the operator
writes them from an RLExperiment, but a user may also create them directly.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .base import GROUP_VERSION, ApiModel, cel
from .progress import Progress
from .spec import (
    KUEUE_FIXED_SIZE,
    MAX_DEVICES_PER_NODE,
    MAX_PODS,
    Backend,
    Engine,
    Parallelism,
    PodPlacement,
    RLExperimentSpec,
    SchedulingSpec,
    StorageSpec,
    TrainerRuntime,
    kueue_cel,
    trainjob_problems,
)
from .tracking import LoggingSpec


class Phase(StrEnum):
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Condition(ApiModel):
    """metav1.Condition."""

    type: str = Field(description="what the condition is about, e.g. Ready, Admitted, Progressing")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown")
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="why, in one CamelCase word (for programs)")
    message: str = Field("", description="why, in words (for people)")
    last_transition_time: str | None = Field(None, description="when status last changed (RFC 3339)")
    observed_generation: int | None = Field(None, description="the metadata.generation it was set for")


class BaseStatus(ApiModel):
    """What the operator observed, written only by it (the status subresource)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}
    phase: Phase | None = Field(None, description="Pending, Running, Suspended, Succeeded or Failed")
    conditions: list[Condition] = Field(default_factory=list, description="the latest observations, one per type")
    observed_generation: int | None = Field(None, description="the metadata.generation this status describes")


SELECTOR_TEXT = Field(None, max_length=512, description="the inference pods' label selector, as text: the scale "
                                                      "subresource's (an HPA measures these pods)")


class AutoscaleStatus(ApiModel):
    """The autoscaler's last change (``spec.inference.autoscale``)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}
    replicas: int | None = Field(None, description="the replica count it set")
    last_scale_time: str | None = Field(None, description="when (RFC 3339)")
    reason: str | None = Field(None, max_length=256, description="the trainer's wait fraction against the target")
    too_few: int | None = Field(None, ge=0, le=MAX_PODS, description="the most replicas found too few (the count "
                                "its last scale-up left), not returned to for a while (kuberl.api.autoscale)")


class PostMortemStatus(ApiModel):
    """Where the operator kept the bundle of a failed experiment (``kuberl_operator.postmortem``)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}
    config_map: str | None = Field(None, max_length=253, description="the ConfigMap holding postmortem.tar.gz: "
                                   "conditions, Events, pods' states and last log lines, progress")
    time: str | None = Field(None, description="when it was gathered (RFC 3339)")
    bytes: int | None = Field(None, ge=0, description="the archive's size")
    reason: str | None = Field(None, max_length=256, description="why it was gathered (the phase)")
    read: str | None = Field(None, max_length=512, description="a shell line that unpacks it")
    error: str | None = Field(None, max_length=512, description="why no bundle could be kept")


class RLExperimentStatus(BaseStatus):
    """What the operator observed of the experiment: phase, conditions, training progress, autoscaling, its
    children and replicas."""

    progress: Progress | None = None
    autoscale: AutoscaleStatus | None = None
    postmortem: PostMortemStatus | None = None
    inference_pool: str | None = Field(None, description="the InferencePool this experiment owns")
    trainer_job: str | None = Field(None, description="the TrainerJob this experiment owns")
    replicas: int | None = Field(None, description="inference replicas that have pods (its pool's; the scale "
                                                   "subresource's current count — spec.inference.replicas the wish)")
    ready_replicas: int | None = Field(None, description="replicas whose every pod is ready")
    selector: str | None = SELECTOR_TEXT


class InferencePoolStatus(BaseStatus):
    """What the operator observed of the pool: phase, conditions, replicas and pods."""

    replicas: int | None = Field(None, description="replicas that have pods (the scale subresource's current "
                                                   "count; spec.replicas is the wish)")
    ready_replicas: int | None = Field(None, description="replicas whose every pod is ready")
    pods: int | None = Field(None, description="the pool's pods")
    ready_pods: int | None = Field(None, description="those ready")
    selector: str | None = SELECTOR_TEXT


class TrainerJobStatus(BaseStatus):
    """What the operator observed of the trainer gang: phase, conditions, pods, restarts and preemptions."""

    nodes: int | None = Field(None, description="the gang's pods")
    ready_nodes: int | None = Field(None, description="those running and ready")
    restarts: int | None = Field(None, description="gang restarts after a rank failed (bounded by backoffLimit)")
    preemptions: int | None = Field(None, description="gang restarts after the cluster took a rank (preemption, "
                                                      "eviction, drain): not failures, not bounded")
    disrupted_pods: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None, max_length=32, description="uids of the disrupted pods already answered by a restart")


class GangMembership(ApiModel):
    """The one admission unit a pool's or job's pods belong to when an RLExperiment owns them: the
    experiment's PodGroup (Volcano, coscheduling) or Kueue pod group, of ``members`` pods in all (the
    pool's and the trainer's), so neither holds accelerators while the other waits."""

    group: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="the pod group's name")
    members: int = Field(ge=1, le=2 * MAX_PODS, description="pods in the whole group (pool and trainer)")


CONFIG_REVISION = ("hash of the run config in the ConfigMap (set by the RLExperiment): pods started with another "
                   "revision are replaced")


class InferencePoolSpec(PodPlacement):
    """A pool of ``replicas × hostsPerReplica`` pods, at most ``MAX_PODS``: the operator builds every pod
    of a pool in memory, so one object's size is bounded before it reaches the operator."""

    model_config = PodPlacement.model_config | {
        "json_schema_extra": cel((f"self.replicas * self.hostsPerReplica <= {MAX_PODS}",
                                  f"replicas * hostsPerReplica: at most {MAX_PODS} pods per pool"),
                                 # a standalone pool's own Kueue pod group (an experiment's pool: its rule)
                                 (f"has(self.gang) || !{kueue_cel('self')} || (has(oldSelf.suspend) && oldSelf.suspend)"
                                  " || self.replicas == oldSelf.replicas",
                                  f"replicas cannot change while a pool in a Kueue queue runs: {KUEUE_FIXED_SIZE}; set "
                                  "suspend: true first, then change replicas and resume"))
    }
    experiment: str | None = Field(None, description="owning RLExperiment, if any")
    config_map: str | None = Field(None, description="ConfigMap with the rendered run config")
    engine: Engine = Field(Engine.VLLM, description="vllm, vllm-ascend or torch (the embedded CPU engine)")
    replicas: int = Field(1, ge=1, le=MAX_PODS, description="model replicas, each serving the whole policy")
    tensor_parallel: int = Field(1, ge=1, description="devices each replica splits every layer over")
    pipeline_parallel: int = Field(1, ge=1, description="stages each replica splits its layers into")
    hosts_per_replica: int = Field(1, ge=1, le=MAX_PODS, description="pods each replica spans")
    accelerators_per_host: int = Field(1, ge=1, description="devices per pod")
    port: int = Field(8000, ge=1024, le=65535, description="the port each replica serves on")
    trainer_address: str | None = Field(
        None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="trainer rank 0's DNS name, where the p2p weight exchange's store listens (set by the "
                    "RLExperiment; a replica never takes this address from a request)")
    config_revision: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}$", description=CONFIG_REVISION)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    gang: GangMembership | None = Field(None, description="set by the RLExperiment: its one gang; a standalone "
                                                          "pool is its own")
    suspend: bool = Field(False, description="true: the pods go until it is false again")

    @model_validator(mode="after")
    def _bounded_pods(self) -> InferencePoolSpec:
        if self.replicas * self.hosts_per_replica > MAX_PODS:
            raise ValueError(f"replicas × hostsPerReplica = {self.replicas} × {self.hosts_per_replica} pods; at most "
                             f"{MAX_PODS} per pool")
        return self


class TrainerJobSpec(PodPlacement):
    """The trainer gang of ``nodes`` pods, ``procsPerNode`` ranks each, started from the run config in a ConfigMap."""

    experiment: str | None = Field(None, description="owning RLExperiment, if any")
    config_map: str | None = Field(None, description="ConfigMap with the rendered run config")
    backend: Backend = Field(Backend.FSDP, description="fsdp (FSDP2) or megatron (megatron-core)")
    runtime: TrainerRuntime = TrainerRuntime.NATIVE
    nodes: int = Field(1, ge=1, le=MAX_PODS, description="trainer pods")
    procs_per_node: int = Field(1, ge=1, le=MAX_DEVICES_PER_NODE, description="ranks (and devices) per pod")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    backoff_limit: int | None = Field(None, ge=0, description="the RLExperiment's trainer.backoffLimit")
    inference_service: str | None = Field(None, description="headless Service of the pool")
    config_revision: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}$", description=CONFIG_REVISION)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec,
                                 description="the RLExperiment's spec.logging: its trackers' credentials for the pods")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    gang: GangMembership | None = Field(None, description="set by the RLExperiment: its one gang; a standalone "
                                                          "job is its own")
    suspend: bool = Field(False, description="true: the pods go until it is false again")

    @model_validator(mode="after")
    def _trainjob_scheduling(self) -> TrainerJobSpec:
        if TrainerRuntime(self.runtime) == TrainerRuntime.TRAINJOB:
            problems = trainjob_problems(self.scheduling, self.backoff_limit, whole_experiment=False)
            if problems:
                raise ValueError("; ".join(f"{field} {why}" for field, why in problems))
        return self


class ObjectMeta(ApiModel):
    model_config = ApiModel.model_config | {"extra": "allow"}
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class Resource(ApiModel):
    """Common envelope; subclasses fix kind, plural and short name."""

    KIND: ClassVar[str]
    PLURAL: ClassVar[str]
    SHORT_NAME: ClassVar[str]

    api_version: Literal["kuberl.io/v1alpha1"] = GROUP_VERSION
    kind: str
    metadata: ObjectMeta


EXPERIMENT_NAME_MAX = 40 - len("-inference")  # children are <name>-inference / <name>-trainer, at most 40
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # Service names derive from it


class RLExperiment(Resource):
    KIND = "RLExperiment"
    PLURAL = "rlexperiments"
    SHORT_NAME = "rlx"
    kind: Literal["RLExperiment"] = "RLExperiment"
    spec: RLExperimentSpec
    status: RLExperimentStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name_fits_every_child(cls, meta: ObjectMeta) -> ObjectMeta:
        if len(meta.name) > EXPERIMENT_NAME_MAX or not re.match(DNS1035_LABEL, meta.name):
            raise ValueError(f"name {meta.name!r}: an RLExperiment's name has at most {EXPERIMENT_NAME_MAX} "
                             "characters (its children add '-inference' / '-trainer') and starts with a letter "
                             "(its Services' names derive from it)")
        return meta


class InferencePool(Resource):
    KIND = "InferencePool"
    PLURAL = "inferencepools"
    SHORT_NAME = "rlpool"
    kind: Literal["InferencePool"] = "InferencePool"
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None


class TrainerJob(Resource):
    KIND = "TrainerJob"
    PLURAL = "trainerjobs"
    SHORT_NAME = "rltrain"
    kind: Literal["TrainerJob"] = "TrainerJob"
    spec: TrainerJobSpec
    status: TrainerJobStatus | None = None


KINDS: dict[str, type[Resource]] = {k.KIND: k for k in (RLExperiment, InferencePool, TrainerJob)}
