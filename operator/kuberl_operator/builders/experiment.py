"""RLExperiment → InferencePool + TrainerJob + ConfigMap (the rendered run config) + NetworkPolicy,
and with spec.agent the agent's Deployment and the gateway's Service."""

from __future__ import annotations

import functools
import hashlib
import json

import yaml

from kuberl.api import (
    GROUP_VERSION,
    FieldIssue,
    InferencePlan,
    InferencePool,
    InferencePoolSpec,
    RLExperiment,
    TrainerJob,
    TrainerJobSpec,
    TrainerPlan,
    resolve,
)
from kuberl.api.contract import (
    CONFIG_FILE,
    LABEL_EXPERIMENT,
    PROGRESS_PORT,
    config_map_name,
    inference_pool_name,
    trainer_job_name,
    trainer_rank0_host,
)
from kuberl.api.resources import GangMembership, Phase
from kuberl.api.spec import GangScheduler, Parallelism, SchedulingSpec, StorageSpec
from kuberl.api.storage import cluster_issues, credentials_secret
from kuberl.api.support import unsupported_issues

from ..accelerators import profile
from ..settings import DEFAULT_BUILD, BuildSettings
from .access import metadata_egress, network_policy
from .agent import build_agent_children
from .common import Manifest, child_metadata
from .gang import pod_group

FINISHED_PHASES = (Phase.SUCCEEDED, Phase.FAILED)  # an agent then has nobody left to talk to


class InvalidSpec(ValueError):
    """The experiment's spec breaks a cross-field rule; ``issues`` names each field."""

    def __init__(self, issues: list[FieldIssue]):
        super().__init__("; ".join(str(i) for i in issues))
        self.issues = issues


@functools.lru_cache(maxsize=4096)
def _run_config_text(run_config_json: str) -> str:
    """The run config as YAML, emitted once per change of the experiment's spec, not once per sync.
    libyaml's emitter when PyYAML has it (1.3 ms a document here; the pure-Python one, the same text,
    5.6 ms)."""
    return yaml.dump(json.loads(run_config_json), Dumper=SAFE_DUMPER, sort_keys=False)


SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def tenancy_issues(scheduling: SchedulingSpec, namespace: str | None, settings: BuildSettings) -> list[FieldIssue]:
    """The queue and PriorityClass ``scheduling`` names that ``namespace`` may not use (``settings.tenancy``)."""
    return [FieldIssue(field, why) for field, why in settings.tenancy.refused(
        namespace or "default", scheduling.queue, scheduling.priority_class_name)]


def _resolved(exp: RLExperiment, settings: BuildSettings = DEFAULT_BUILD) -> tuple[InferencePlan, TrainerPlan]:
    """The spec's resolved inference and trainer layouts; raises ``InvalidSpec`` naming every field
    that breaks a cross-field rule or the operator's tenancy settings."""
    inference, trainer, issues = resolve(exp.spec)
    issues += unsupported_issues(exp.spec, trainer) + cluster_issues(exp.spec, exp.metadata.name)
    issues += tenancy_issues(exp.spec.scheduling, exp.metadata.namespace, settings)
    if issues or inference is None or trainer is None:
        raise InvalidSpec(issues)
    return inference, trainer


def check_experiment(exp: RLExperiment, settings: BuildSettings = DEFAULT_BUILD) -> None:
    """Raise ``InvalidSpec`` naming every field that breaks a cross-field rule (what
    ``build_experiment_children`` checks first, without building anything)."""
    _resolved(exp, settings)


PLACEMENT_KEYS = {"accelerator", "image", "resources", "node_selector", "tolerations"}


def experiment_gang(exp: RLExperiment, inference: InferencePlan, trainer: TrainerPlan) -> GangMembership | None:
    """The experiment's one admission unit — the pool's pods and the trainer's together — when a gang
    scheduler or a Kueue queue is asked for (``builders.gang``)."""
    scheduling = exp.spec.scheduling
    if GangScheduler(scheduling.gang) == GangScheduler.NONE and not scheduling.queue:
        return None
    return GangMembership(group=exp.metadata.name,
                          members=inference.replicas * inference.hosts_per_replica + trainer.nodes)


def _pool_spec(exp: RLExperiment, inference: InferencePlan, revision: str,
               gang: GangMembership | None) -> InferencePoolSpec:
    name, spec = exp.metadata.name, exp.spec
    return InferencePoolSpec(
        **spec.inference.model_dump(include=PLACEMENT_KEYS),
        experiment=name,
        config_map=config_map_name(name),
        engine=inference.engine,
        replicas=inference.replicas,
        tensor_parallel=inference.tensor_parallel,
        pipeline_parallel=inference.pipeline_parallel,
        hosts_per_replica=inference.hosts_per_replica,
        accelerators_per_host=inference.devices_per_host,
        port=spec.inference.port,
        trainer_address=trainer_rank0_host(trainer_job_name(name), exp.metadata.namespace, spec.trainer.runtime),
        config_revision=revision,
        storage=_storage(exp),
        scheduling=spec.scheduling,
        gang=gang,
        suspend=spec.suspend,
    )


def _job_spec(exp: RLExperiment, trainer: TrainerPlan, revision: str, gang: GangMembership | None) -> TrainerJobSpec:
    name, spec = exp.metadata.name, exp.spec
    return TrainerJobSpec(
        **spec.trainer.model_dump(include=PLACEMENT_KEYS),
        experiment=name,
        config_map=config_map_name(name),
        backend=trainer.backend,
        runtime=spec.trainer.runtime,
        nodes=trainer.nodes,
        procs_per_node=trainer.procs_per_node,
        parallelism=Parallelism(
            data=trainer.data, tensor=trainer.tensor, pipeline=trainer.pipeline,
            context=trainer.context, expert=trainer.expert, expert_tensor=trainer.expert_tensor,
        ),
        backoff_limit=spec.trainer.backoff_limit,
        inference_service=inference_pool_name(name),
        config_revision=revision,
        storage=_storage(exp),
        logging=spec.logging,
        scheduling=spec.scheduling,
        gang=gang,
        suspend=spec.suspend,
    )


def _storage(exp: RLExperiment) -> StorageSpec:
    return exp.spec.storage.model_copy(update={"credentials_secret": credentials_secret(exp.spec)})


def _run_config(exp: RLExperiment, parent: Manifest) -> tuple[str, str]:
    """(the run config the pods read, as YAML, from the experiment's spec and identity; the same
    without ``spec.inference.replicas``, as JSON: what a pod's revision hashes — a resize replaces no
    pod, the trainer follows its pool in the mounted file: ``kuberl.trainer.pool.follow_pool``)."""
    name = exp.metadata.name
    spec = exp.spec.to_wire()
    run_config = {
        "experiment": name,
        "namespace": exp.metadata.namespace,
        **({"runId": parent["metadata"]["uid"]} if parent["metadata"].get("uid") else {}),
        "spec": spec,
        "inferencePool": inference_pool_name(name),
        "trainerJob": trainer_job_name(name),
    }
    text = _run_config_text(json.dumps(run_config, sort_keys=False))
    unsized = {**run_config, "spec": {**spec, "inference": {k: v for k, v in spec.get("inference", {}).items()
                                                            if k != "replicas"}}}
    return text, json.dumps(unsized, sort_keys=True)


def build_experiment_children(exp: RLExperiment, parent: Manifest, settings: BuildSettings = DEFAULT_BUILD,
                              token_version: str = "") -> list[Manifest]:
    """ConfigMap, the experiment's PodGroup (with a gang scheduler: one for the pool's and the trainer's
    pods), InferencePool, TrainerJob and NetworkPolicy for ``exp`` (and the agent's Deployment and
    gateway Service with ``spec.agent``); raises ``InvalidSpec``.
    ``settings``: the operator's (images, Ascend details, ``peers``: who else may reach the pods).
    The API token Secrets are not among them: they hold random values (``children.ensure_api_token``);
    ``token_version`` (``access.token_version`` of them) is part of the config revision, so every pod
    started with another token is replaced: configRevision = SHA-256(run config without
    ``spec.inference.replicas`` + token_version)[:16] — a resize replaces no pod (:func:`_run_config`)."""
    inference, trainer = _resolved(exp, settings)
    name, spec = exp.metadata.name, exp.spec
    labels = {LABEL_EXPERIMENT: name}
    config_text, unsized = _run_config(exp, parent)
    revision = hashlib.sha256((unsized + token_version).encode()).hexdigest()[:16]
    config_map: Manifest = {"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": child_metadata(parent, config_map_name(name), labels),
                            "data": {CONFIG_FILE: config_text}}
    gang = experiment_gang(exp, inference, trainer)
    pool = {"apiVersion": GROUP_VERSION, "kind": InferencePool.KIND,
            "metadata": child_metadata(parent, inference_pool_name(name), labels),
            "spec": _pool_spec(exp, inference, revision, gang).to_wire()}
    job = {"apiVersion": GROUP_VERSION, "kind": TrainerJob.KIND,
           "metadata": child_metadata(parent, trainer_job_name(name), labels),
           "spec": _job_spec(exp, trainer, revision, gang).to_wire()}
    accelerator_labels = {**profile(spec.inference.accelerator, str(inference.engine), settings).labels,
                          **profile(spec.trainer.accelerator, settings=settings).labels}
    group = pod_group(parent, name, gang.members, spec.scheduling, accelerator_labels) if gang else None
    policy = network_policy(parent, name, settings.peers, [spec.inference.port, PROGRESS_PORT],
                            metadata=metadata_egress(spec.storage, settings))
    finished = (parent.get("status") or {}).get("phase") in FINISHED_PHASES
    agent = [] if spec.agent is None else build_agent_children(
        parent, name, spec.agent, spec.trainer.image or profile(spec.trainer.accelerator, settings=settings).image,
        spec.trainer.runtime, running=not (spec.suspend or finished),
        token_version=token_version)
    return [config_map, *([group] if group else []), pool, job, policy, *agent]
