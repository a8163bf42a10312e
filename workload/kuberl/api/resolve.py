"""Turn a spec (plus its optional allocation string) into concrete pool sizes, or field errors.

This is the one place where cross-field rules live. ``resolve`` is pure and total: it never
raises for bad input; it returns every problem it finds as a ``FieldIssue`` naming the field.

Sizes, with η-free notation (A = acceleratorsPerNode):

* inference: devices per replica = t·p; hosts per replica = 1 if t·p ≤ A, else t·p / A
  (which must be whole); devices per inference pod = min(t·p, A).
* trainer: world W = nodes·A (or the allocation's device count); data parallel
  d = W / (t·p·c) must be whole; the MoE layout needs e·etp·p | W.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocation import Allocation, AllocationError, Dims, parse_allocation
from .rewards import in_kuberl_package
from .spec import KUEUE_FIXED_SIZE, MAX_PODS, Accelerator, Backend, Engine, RLExperimentSpec

EXTENDED_RESOURCE = {Accelerator.NVIDIA: "nvidia.com/gpu", Accelerator.ASCEND: "huawei.com/Ascend910"}


@dataclass(frozen=True)
class FieldIssue:
    path: str  # dotted camelCase path, e.g. "spec.trainer.nodes"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def cluster_warnings(spec: RLExperimentSpec) -> list[FieldIssue]:
    """What a cluster run of ``spec`` would regret without failing: no ``spec.checkpoint.uri`` means the
    trainer writes no checkpoint and no export, and the trained model goes with the pods (``kuberl run``
    keeps its own in its work dir); ``spec.observability`` without an ``otlpEndpoint`` traces nothing
    there (``kuberl run`` writes its work dir's traces.jsonl). ``kuberl validate`` prints these; the
    operator puts them in the experiment's ``SpecValid`` condition."""
    warnings = []
    if spec.checkpoint.uri is None:
        warnings.append(FieldIssue(
            "spec.checkpoint.uri", "is unset: on a cluster this run writes no checkpoint and no export, so the trained "
                                   "model is lost when its pods go; set s3://bucket/prefix/ or a claim's file:///path "
                                   "(kuberl run checkpoints to its work dir)"))
    if spec.observability is not None and spec.observability.otlp_endpoint is None:
        warnings.append(FieldIssue(
            "spec.observability.otlpEndpoint", "is unset: on a cluster no trace leaves the pods; set an OTLP/HTTP "
                                               "collector, e.g. http://otel-collector.observability:4318 (kuberl run "
                                               "writes traces.jsonl in its work dir)"))
    return warnings


@dataclass(frozen=True)
class InferencePlan:
    engine: Engine
    replicas: int
    tensor_parallel: int
    pipeline_parallel: int
    hosts_per_replica: int
    devices_per_host: int

    @property
    def pods(self) -> int:
        return self.replicas * self.hosts_per_replica


@dataclass(frozen=True)
class TrainerPlan:
    backend: Backend
    nodes: int
    procs_per_node: int
    data: int
    tensor: int
    pipeline: int
    context: int
    expert: int
    expert_tensor: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass
class _Issues:
    items: list[FieldIssue] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.items.append(FieldIssue(path, message))

    def agree(self, path: str, given: object, implied: object, source: str) -> None:
        """Record a conflict when a field is set and disagrees with what ``source`` implies."""
        if given is not None and given != implied:
            self.add(path, f"is {given} but {source} implies {implied}; remove it or make them agree")


def resolve(spec: RLExperimentSpec) -> tuple[InferencePlan | None, TrainerPlan | None, list[FieldIssue]]:
    """Effective sizes of both pools, and every cross-field problem found."""
    issues = _Issues()
    alloc: Allocation | None = None
    if spec.allocation is not None:
        try:
            alloc = parse_allocation(spec.allocation)
        except AllocationError as err:
            issues.add("spec.allocation", str(err))
            return None, None, issues.items
    inference = _resolve_inference(spec, alloc, issues)
    trainer = _resolve_trainer(spec, alloc, issues)
    _check_agent(spec, issues)
    _check_admission(spec, issues)
    return inference, trainer, issues.items


def _check_admission(spec: RLExperimentSpec, issues: _Issues) -> None:
    """A Kueue pod group keeps the size it was admitted at (the CRD refuses a resize of a running
    experiment in a Kueue queue too: a transition rule, which needs the old object)."""
    if spec.scheduling.kueue_queue and spec.inference.autoscale is not None:
        issues.add("spec.inference.autoscale", f"is set with a Kueue queue (spec.scheduling.queue "
                                               f"{spec.scheduling.kueue_queue!r}): {KUEUE_FIXED_SIZE}, so every resize "
                                               "would re-queue the experiment; remove autoscale, or use gang volcano")


def _check_agent(spec: RLExperimentSpec, issues: _Issues) -> None:
    """With ``spec.agent`` the user's agent drives every episode (and runs its own tools); a workflow
    (``spec.rollout.workflow``) is the user's own module, not one of KubeRL's."""
    workflow = spec.rollout.workflow
    if workflow is not None and in_kuberl_package(workflow):
        issues.add("spec.rollout.workflow", f"{workflow!r}: KubeRL's own workflows are chosen by spec.rollout.tools "
                                            "(none: single-turn; tools: multi-turn); name your own module here")
    if spec.agent is None:
        return
    if workflow is not None:
        issues.add("spec.rollout.workflow", "spec.agent drives every episode, so no workflow runs; "
                                            "remove one of the two")
    if spec.rollout.tools:
        issues.add("spec.rollout.tools", "the built-in tool workflow does not run when spec.agent drives the "
                                         "episodes (the agent runs its own tools); remove one of the two")
    if spec.evaluation is not None:
        issues.add("spec.evaluation", "evaluation runs the built-in workflow on spec.dataset; with spec.agent the "
                                      "agent drives the episodes (report evaluation from the agent); remove one")


def _check_device_request(spec_path: str, placement, per_pod: int, issues: _Issues) -> None:
    resource = EXTENDED_RESOURCE.get(Accelerator(placement.accelerator))
    if placement.resources is None or resource is None:
        return
    for kind in ("requests", "limits"):
        given = (getattr(placement.resources, kind) or {}).get(resource)
        if given is not None and given != str(per_pod):
            issues.add(
                f"{spec_path}.resources.{kind}.{resource}",
                f"is {given} but each pod needs {per_pod} devices; omit it (the operator sets it)",
            )


def _resolve_inference(spec: RLExperimentSpec, alloc: Allocation | None, issues: _Issues) -> InferencePlan | None:
    inf = spec.inference
    accel = Accelerator(inf.accelerator)
    before = len(issues.items)
    src = f"allocation {spec.allocation!r}"
    if alloc is not None:
        a = alloc.inference
        issues.agree("spec.inference.engine", inf.engine, a.engine, src)
        issues.agree("spec.inference.tensorParallel", inf.tensor_parallel, a.dims.tensor, src)
        issues.agree("spec.inference.pipelineParallel", inf.pipeline_parallel, a.dims.pipeline, src)
        # replicas, when given, is the count: the scale subresource writes it (the allocation's d starts it)
        engine, tp, pp = Engine(a.engine), a.dims.tensor, a.dims.pipeline
        replicas = inf.replicas if inf.replicas is not None else a.dims.data
    else:
        default_engine = Engine.TORCH if accel == Accelerator.CPU else Engine.VLLM
        engine = Engine(inf.engine or default_engine)
        replicas, tp, pp = inf.replicas or 1, inf.tensor_parallel or 1, inf.pipeline_parallel or 1
    if engine == Engine.TORCH and accel == Accelerator.ASCEND:
        issues.add("spec.inference.engine", "torch engine supports nvidia and cpu; use vllm (vLLM-Ascend) on ascend")
    per_replica, per_node = tp * pp, inf.accelerators_per_node
    if engine == Engine.TORCH:
        _check_torch_layout(spec, tp, pp, per_node, issues)
    if per_replica <= per_node:
        hosts, per_host = 1, per_replica
    elif per_replica % per_node == 0:
        hosts, per_host = per_replica // per_node, per_node
    else:
        issues.add(
            "spec.inference.tensorParallel",
            f"a replica needs tensorParallel×pipelineParallel = {per_replica} devices, which must be "
            f"≤ acceleratorsPerNode ({per_node}) or a multiple of it",
        )
        hosts, per_host = 1, per_replica
    if replicas > MAX_PODS:
        issues.add("spec.allocation", f"implies {replicas} inference replicas; at most {MAX_PODS}")
    if hosts > 1 and engine != Engine.TORCH:
        issues.add(
            "spec.inference.tensorParallel",
            f"a replica of tensorParallel×pipelineParallel = {per_replica} devices would span {hosts} hosts of "
            f"{per_node} (acceleratorsPerNode); engine {engine} does not serve a replica over several hosts yet "
            "(engine torch does): use at most acceleratorsPerNode devices per replica",
        )
    _check_device_request("spec.inference", inf, per_host, issues)
    if len(issues.items) > before:
        return None
    return InferencePlan(engine, replicas, tp, pp, hosts, per_host)


def _check_torch_layout(spec: RLExperimentSpec, tp: int, pp: int, per_node: int, issues: _Issues) -> None:
    """Engine torch: one process per host, each with one device, splitting every layer tensor-parallel
    (``kuberl.inference.tensor_parallel``): no pipeline stages, and a split replica has one device a host."""
    if pp != 1:
        issues.add("spec.inference.pipelineParallel", "engine torch has no pipeline stages: pipelineParallel must be 1")
    if tp > 1 and per_node != 1:
        issues.add("spec.inference.acceleratorsPerNode",
                   f"engine torch splits a replica over tensorParallel = {tp} processes of one device each: "
                   f"acceleratorsPerNode must be 1 (is {per_node})")
    if tp > 1 and spec.trainer.lora is not None:
        issues.add("spec.inference.tensorParallel",
                   "engine torch does not split a model with a LoRA adapter (spec.trainer.lora): tensorParallel 1")


def _resolve_trainer(spec: RLExperimentSpec, alloc: Allocation | None, issues: _Issues) -> TrainerPlan | None:
    tr, par = spec.trainer, spec.trainer.parallelism
    before = len(issues.items)
    per_node = tr.accelerators_per_node
    src = f"allocation {spec.allocation!r}"
    if alloc is not None:
        a = alloc.trainer
        issues.agree("spec.trainer.backend", tr.backend, a.backend, src)
        backend, dims, ffn = Backend(a.backend), a.attn, a.ffn
        world = a.devices
        procs = min(per_node, world)
        if world % procs:
            issues.add(
                "spec.trainer.acceleratorsPerNode",
                f"the allocation's {world} trainer devices do not fill whole nodes of {per_node}",
            )
        nodes = max(world // procs, 1)
        issues.agree("spec.trainer.nodes", tr.nodes, nodes, src)
        for name in ("data", "tensor", "pipeline", "context"):
            issues.agree(f"spec.trainer.parallelism.{name}", getattr(par, name), getattr(dims, name), src)
        expert = ffn.expert if ffn else 1
        expert_tensor = ffn.tensor if ffn else 1
        issues.agree("spec.trainer.parallelism.expert", par.expert, expert, src)
        issues.agree("spec.trainer.parallelism.expertTensor", par.expert_tensor, expert_tensor, src)
    else:
        backend = Backend(tr.backend or Backend.FSDP)
        nodes, procs = tr.nodes or 1, per_node
        world = nodes * procs
        tp, pp, cp = par.tensor or 1, par.pipeline or 1, par.context or 1
        data = par.data if par.data is not None else max(world // (tp * pp * cp), 1)
        dims = Dims(data=data, tensor=tp, pipeline=pp, context=cp)
        if dims.world_size != world:
            issues.add(
                "spec.trainer.parallelism",
                f"data×tensor×pipeline×context = {dims.data}×{tp}×{pp}×{cp} = {dims.world_size} "
                f"must equal nodes×acceleratorsPerNode = {nodes}×{per_node} = {world}",
            )
        expert, expert_tensor = par.expert or 1, par.expert_tensor or 1
    if backend == Backend.FSDP and (dims.tensor, dims.pipeline, expert) != (1, 1, 1):
        issues.add(
            "spec.trainer.parallelism",
            "backend fsdp shards over data only; use backend megatron for tensor, "
            "pipeline or expert parallelism",
        )
    if nodes > MAX_PODS:
        issues.add("spec.allocation", f"implies {nodes} trainer nodes; at most {MAX_PODS}")
    if dims.context > 1 and backend == Backend.FSDP:
        issues.add(
            "spec.trainer.parallelism.context",
            f"is {dims.context}: backend fsdp does not split sequences; use backend megatron for context "
            "parallelism, or remove it (or the c in the allocation)",
        )
    moe_span = expert * expert_tensor * dims.pipeline
    if world % moe_span:
        issues.add(
            "spec.trainer.parallelism.expert",
            f"expert×expertTensor×pipeline = {moe_span} must divide the {world} trainer devices",
        )
    _check_device_request("spec.trainer", tr, procs, issues)
    if len(issues.items) > before:
        return None
    return TrainerPlan(
        backend, nodes, procs, dims.data, dims.tensor, dims.pipeline, dims.context, expert, expert_tensor
    )
