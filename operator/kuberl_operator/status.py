"""Pure status aggregation: pods → InferencePool / TrainerJob status → RLExperiment status.

Phases: Pending, Initializing, Running, Suspended, Succeeded, Failed.
Conditions are metav1.Condition dicts. A child's problem (ImagePullBackOff, CrashLoopBackOff, a
Failed pod, Unschedulable) surfaces as ``Degraded=True`` with the pod's reason and message, and
climbs to the RLExperiment. Deterministic errors (bad image, bad config) fail fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kuberl.api import Phase
from kuberl.api.contract import LABEL_REPLICA, TRAINJOB_NODE
from kuberl.api.roles import gang_may_restart

Manifest = dict[str, Any]

# Waiting reasons that mean "this will not fix itself": fail fast.
DETERMINISTIC = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError"}
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue puts on a pod until admission
QUEUED = "QueuedForAdmission"  # the Ready reason while every unscheduled pod waits for Kueue
# Waiting reasons that degrade a pool but may recover (or be replaced).
TRANSIENT = {"CrashLoopBackOff", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class PodHealth:
    name: str
    phase: str
    ready: bool
    scheduled: bool
    problem: tuple[str, str] | None = None  # (reason, message)
    queued: bool = False  # held by Kueue's admission gate: its pod group is not admitted yet

    @property
    def deterministic_failure(self) -> bool:
        return self.problem is not None and self.problem[0] in DETERMINISTIC


def _condition(pod: Manifest, kind: str) -> Manifest:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def pod_health(pod: Manifest) -> PodHealth:
    """Summarise one pod: ready, scheduled, and its most telling problem if any."""
    status = pod.get("status") or {}
    name = pod["metadata"]["name"]
    phase = status.get("phase", "Pending")
    ready = _condition(pod, "Ready").get("status") == "True"
    scheduled_cond = _condition(pod, "PodScheduled")
    scheduled = bool(pod.get("spec", {}).get("nodeName")) or scheduled_cond.get("status") == "True"
    problem: tuple[str, str] | None = None
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in DETERMINISTIC | TRANSIENT:
            problem = (waiting["reason"], waiting.get("message") or f"container {cs.get('name')} is waiting")
            break
    if phase == "Failed" and problem is None:
        terminated = next(
            ((cs.get("state") or {}).get("terminated") for cs in status.get("containerStatuses") or []
             if (cs.get("state") or {}).get("terminated")), None,
        ) or {}
        reason = terminated.get("reason") or status.get("reason") or "PodFailed"
        code = terminated.get("exitCode")
        detail = terminated.get("message") or status.get("message") or ""
        problem = ("PodFailed", f"{reason}" + (f" (exit code {code})" if code is not None else "")
                   + (f": {detail}" if detail else ""))
    if problem is None and scheduled_cond.get("reason") == "Unschedulable":
        problem = ("Unschedulable", scheduled_cond.get("message") or "no node fits the pod")
    queued = any(g.get("name") == KUEUE_ADMISSION_GATE for g in pod.get("spec", {}).get("schedulingGates") or [])
    return PodHealth(name, phase, ready, scheduled, problem, queued)


def condition(kind: str, ok: bool, reason: str, message: str = "", generation: int | None = None) -> Manifest:
    cond: Manifest = {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(old: list[Manifest], new: list[Manifest], now: str) -> list[Manifest]:
    """New conditions, keeping ``lastTransitionTime`` where a condition's status did not change."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        keep = before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime")
        out.append({**cond, "lastTransitionTime": before["lastTransitionTime"] if keep else now})
    return out


def _pods_phase(expected: int, healths: list[PodHealth]) -> Phase:
    ready = sum(h.ready for h in healths)
    if expected and ready >= expected:
        return Phase.RUNNING
    if any(h.scheduled for h in healths):
        return Phase.INITIALIZING
    return Phase.PENDING


def _problem_condition(healths: list[PodHealth], generation: int | None) -> Manifest:
    for h in sorted(healths, key=lambda h: (not h.deterministic_failure, h.name)):
        if h.problem:
            return condition("Degraded", True, h.problem[0], f"pod {h.name}: {h.problem[1]}", generation)
    return condition("Degraded", False, "AsExpected", "", generation)


def _ready(phase: Phase, running_reason: str, message: str, generation: int | None,
           healths: Sequence[PodHealth] = ()) -> Manifest:
    """The Ready condition: True only while Running (reason ``running_reason``), else the phase —
    ``QueuedForAdmission`` while Pending with pods Kueue has not admitted yet."""
    running = phase == Phase.RUNNING
    queued = sum(h.queued for h in healths)
    if phase == Phase.PENDING and queued:
        return condition("Ready", False, QUEUED, f"{message}; {queued} pod(s) wait for Kueue to admit the "
                                                 "experiment's pod group", generation)
    return condition("Ready", running, running_reason if running else phase.value, message, generation)


def label_selector_text(selector: dict[str, str]) -> str:
    """``{"a": "1", "b": "2"}`` → ``"a=1,b=2"`` (sorted): the form a scale subresource's
    ``labelSelectorPath`` points to (an HPA lists the pods it measures with it)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def pool_status(spec: Manifest, generation: int | None, pods: list[Manifest], selector: dict[str, str]) -> Manifest:
    """InferencePool status. A failed replica degrades the pool; a bad image fails it. ``replicas``:
    how many replicas have pods (the scale subresource's current count; ``spec.replicas`` is the
    desired one), ``selector``: the pool's pods, as text (the scale subresource's)."""
    hosts = spec.get("hostsPerReplica", 1)
    expected = spec.get("replicas", 1) * hosts
    healths = [pod_health(p) for p in pods]
    ready_pods = sum(h.ready for h in healths)
    members: dict[str, list[PodHealth]] = {}
    for pod, health in zip(pods, healths, strict=True):
        replica = (pod["metadata"].get("labels") or {}).get(LABEL_REPLICA)
        members.setdefault(replica or "", []).append(health)
    ready_replicas = sum(len(members.get(str(r), [])) == hosts and all(m.ready for m in members[str(r)])
                         for r in range(spec.get("replicas", 1)))
    degraded = _problem_condition(healths, generation)
    if spec.get("suspend"):
        phase = Phase.SUSPENDED
    elif any(h.deterministic_failure for h in healths):
        phase = Phase.FAILED
    else:
        phase = _pods_phase(expected, healths)
    ready = _ready(phase, "AllReplicasReady", f"{ready_replicas}/{spec.get('replicas', 1)} replicas ready", generation,
                   healths)
    return {
        "phase": phase.value, "observedGeneration": generation, "replicas": len(set(members) - {""}),
        "readyReplicas": ready_replicas, "pods": len(pods), "readyPods": ready_pods,
        "selector": label_selector_text(selector), "conditions": [ready, degraded],
    }


# status.reason of a pod the kubelet ended for the node's sake, not for its program's: node-pressure
# eviction, preemption by a critical pod, graceful node shutdown, a lost node.
KUBELET_DISRUPTIONS = {"Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated", "NodeLost"}
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")  # Kubernetes'; Kueue's for plain pods
ACKNOWLEDGED_KEEP = 32  # disrupted pods' uids a TrainerJob's status remembers (each restarts the gang once)


def disruption(pod: Manifest) -> str | None:
    """Why the cluster, not the pod's program, ended ``pod`` — its ``DisruptionTarget`` condition
    (scheduler preemption, an API eviction such as a node drain, a taint, the kubelet), Kueue's
    ``TerminationTarget`` (``StoppedByKueue``: a plain-pod group preempted or evicted by Kueue, which
    writes that condition and deletes the pods), or a kubelet reason in ``KUBELET_DISRUPTIONS`` — or None."""
    target = next((c for kind in DISRUPTION_CONDITIONS if (c := _condition(pod, kind)).get("status") == "True"), {})
    status = pod.get("status") or {}
    if target:
        reason, message = target.get("reason") or target["type"], target.get("message") or ""
    elif status.get("phase") == "Failed" and status.get("reason") in KUBELET_DISRUPTIONS:
        reason, message = status["reason"], status.get("message") or ""
    else:
        return None
    return f"{reason}: {message}" if message else reason


@dataclass(frozen=True)
class GangRestart:
    reason: str
    preempted: bool  # the cluster took a rank: not counted against backoffLimit
    disrupted: tuple[str, ...] = ()  # uids of the disrupted pods this restart answers


def gang_restart(pods: list[Manifest], restarts: int, backoff_limit: int,
                 acknowledged: frozenset[str] = frozenset()) -> GangRestart | None:
    """Why the whole trainer gang must restart now, or None.

    The cluster took a rank away (:func:`disruption`: preemption, eviction, a drain, a node's shutdown
    — seen on a live or a terminating pod): every rank restarts from the last checkpoint, and
    ``backoffLimit`` is not consumed — a preemption is not a failure. Each disrupted pod answers one
    restart (its uid is then in ``acknowledged``), however long it takes to go.
    A rank failed at run time (its pod phase Failed: a crash, an OOM kill) stops the collective for
    every rank, so all ranks restart together — at most ``backoff_limit`` times. Deterministic problems
    (a bad image or config) would fail again, so they never restart; past the limit the job fails
    (``job_status``).
    """
    ordered = sorted(pods, key=lambda p: p["metadata"]["name"])
    disrupted = [(p, why) for p in ordered if (why := disruption(p)) and p["metadata"].get("uid") not in acknowledged]
    if disrupted:
        pod, why = disrupted[0]
        return GangRestart(f"pod {pod['metadata']['name']}: {why}", True,
                           tuple(p["metadata"].get("uid") or "" for p, _ in disrupted))
    if not gang_may_restart(restarts, backoff_limit):
        return None
    live = [p for p in ordered if not p["metadata"].get("deletionTimestamp")]
    for health in (pod_health(p) for p in live):
        if health.phase == "Failed" and not health.deterministic_failure:
            return GangRestart(f"pod {health.name}: {health.problem[1] if health.problem else 'Failed'}", False)
    return None


def job_status(spec: Manifest, generation: int | None, pods: list[Manifest], restarts: int = 0,
               preemptions: int = 0, acknowledged: list[str] | None = None) -> Manifest:
    """TrainerJob status: the gang succeeds when every rank succeeded, fails when any rank failed.
    ``preemptions``: gang restarts because the cluster took a rank (``acknowledged``: those pods' uids)."""
    nodes = spec.get("nodes", 1)
    healths = [pod_health(p) for p in pods]
    degraded = _problem_condition(healths, generation)
    succeeded = sum(h.phase == "Succeeded" for h in healths)
    if spec.get("suspend"):
        phase = Phase.SUSPENDED
    elif succeeded >= nodes:
        phase = Phase.SUCCEEDED
    elif any(h.phase == "Failed" or h.deterministic_failure for h in healths):
        phase = Phase.FAILED
    else:
        phase = _pods_phase(nodes, healths)
    ready_nodes = sum(h.ready for h in healths)
    ready = _ready(phase, "AllRanksReady", f"{ready_nodes}/{nodes} nodes ready", generation, healths)
    return {
        "phase": phase.value, "observedGeneration": generation, "nodes": nodes,
        "readyNodes": ready_nodes, "restarts": restarts, "preemptions": preemptions,
        **({"disruptedPods": acknowledged[-ACKNOWLEDGED_KEEP:]} if acknowledged else {}),
        "conditions": [ready, degraded],
    }


KUBEFLOW_PHASES = {"Created": Phase.INITIALIZING, "Running": Phase.RUNNING, "Restarting": Phase.RUNNING,
                   "Succeeded": Phase.SUCCEEDED, "Failed": Phase.FAILED, "Suspended": Phase.SUSPENDED}


def pytorchjob_status(spec: Manifest, generation: int | None, pytorchjob: Manifest | None,
                      restarts: int = 0) -> Manifest:
    """TrainerJob status (runtime kubeflow) from the PyTorchJob's status, which the Kubeflow
    training operator writes: the newest true condition of Created / Running / Restarting /
    Succeeded / Failed / Suspended gives the phase; a Restarting or Failed condition's reason and
    message surface as Degraded; ``replicaStatuses`` gives the running node count."""
    nodes = spec.get("nodes", 1)
    status = (pytorchjob or {}).get("status") or {}
    current = [c for c in status.get("conditions") or [] if c.get("status") == "True" and c.get("type") in
               KUBEFLOW_PHASES]  # fmt: skip
    latest = max(current, key=lambda c: c.get("lastTransitionTime") or "", default=None) if current else None
    phase = Phase.SUSPENDED if spec.get("suspend") else KUBEFLOW_PHASES[latest["type"]] if latest else Phase.PENDING
    active = sum(int((r or {}).get("active") or 0) for r in (status.get("replicaStatuses") or {}).values())
    if latest is not None and latest["type"] in ("Restarting", "Failed"):
        degraded = condition("Degraded", True, latest.get("reason") or latest["type"],
                             f"PyTorchJob: {latest.get('message', '')}", generation)
    else:
        degraded = condition("Degraded", False, "AsExpected", "", generation)
    state = f"PyTorchJob {latest['type'] if latest else 'not started'}"
    return {
        "phase": phase.value, "observedGeneration": generation, "nodes": nodes,
        "readyNodes": active if phase == Phase.RUNNING else 0, "restarts": restarts,
        "conditions": [_ready(phase, "PyTorchJobRunning", state, generation), degraded],
    }


def trainjob_status(spec: Manifest, generation: int | None, trainjob: Manifest | None, restarts: int = 0) -> Manifest:
    """TrainerJob status (runtime trainjob) from the TrainJob's status, which Kubeflow Trainer writes:
    condition Complete → Succeeded, Failed → Failed (its reason and message as Degraded); Suspended
    while our spec does not suspend it → Pending, ``QueuedForAdmission`` (Kueue suspends a TrainJob
    until it admits it); else the child Job "node" in ``jobsStatus``: ready → Running with every node
    ready, active → Initializing, nothing yet → Pending."""
    nodes = spec.get("nodes", 1)
    status = (trainjob or {}).get("status") or {}
    true = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    node = next((j for j in status.get("jobsStatus") or [] if j.get("name") == TRAINJOB_NODE), {})
    queued = False
    if "Complete" in true:
        phase = Phase.SUCCEEDED
    elif "Failed" in true:
        phase = Phase.FAILED
    elif spec.get("suspend"):
        phase = Phase.SUSPENDED
    elif "Suspended" in true:
        phase, queued = Phase.PENDING, True
    else:
        phase = Phase.RUNNING if node.get("ready") else Phase.INITIALIZING if node.get("active") else Phase.PENDING
    failed = true.get("Failed")
    degraded = (condition("Degraded", True, failed.get("reason") or "Failed", f"TrainJob: {failed.get('message', '')}",
                          generation) if failed else condition("Degraded", False, "AsExpected", "", generation))
    state = f"TrainJob {phase.value}"
    ready = (condition("Ready", False, QUEUED, f"{state}; the TrainJob waits for Kueue to admit it", generation)
             if queued else _ready(phase, "TrainJobRunning", state, generation))
    return {
        "phase": phase.value, "observedGeneration": generation, "nodes": nodes,
        "readyNodes": nodes if phase == Phase.RUNNING else 0, "restarts": restarts,
        "conditions": [ready, degraded],
    }


def _ready_reason(status: Manifest | None) -> str | None:
    return next((c.get("reason") for c in (status or {}).get("conditions") or [] if c.get("type") == "Ready"), None)


def _child_degraded(kind: str, name: str, status: Manifest | None) -> Manifest | None:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("status") == "True":
            return {**cond, "message": f"{kind} {name}: {cond.get('message', '')}"}
    return None


def experiment_status(
    generation: int | None,
    suspend: bool,
    pool: tuple[str, Manifest | None],
    job: tuple[str, Manifest | None],
    warnings: tuple[str, ...] = (),
) -> Manifest:
    """RLExperiment status from its children's (name, status) pairs; the trainer decides the end.
    ``warnings`` (``kuberl.api.resolve.cluster_warnings``): the spec is valid but would lose something;
    ``SpecValid`` says so (reason ``ValidWithWarnings``)."""
    pool_name, pool_st = pool
    job_name, job_st = job
    pool_phase = (pool_st or {}).get("phase")
    job_phase = (job_st or {}).get("phase")
    if suspend:
        phase = Phase.SUSPENDED
    elif job_phase == Phase.SUCCEEDED:
        phase = Phase.SUCCEEDED
    elif Phase.FAILED in (job_phase, pool_phase):
        phase = Phase.FAILED
    elif job_phase == Phase.RUNNING and pool_phase == Phase.RUNNING:
        phase = Phase.RUNNING
    elif Phase.INITIALIZING in (job_phase, pool_phase) or Phase.RUNNING in (job_phase, pool_phase):
        phase = Phase.INITIALIZING
    else:
        phase = Phase.PENDING
    queued = phase == Phase.PENDING and QUEUED in (_ready_reason(job_st), _ready_reason(pool_st))
    degraded = (_child_degraded("TrainerJob", job_name, job_st)
                or _child_degraded("InferencePool", pool_name, pool_st)
                or condition("Degraded", False, "AsExpected"))
    degraded = {**degraded, "observedGeneration": generation}
    scale = {k: (pool_st or {})[k] for k in ("replicas", "readyReplicas", "selector") if k in (pool_st or {})}
    return {
        "phase": phase.value,
        "observedGeneration": generation,
        "inferencePool": pool_name,
        "trainerJob": job_name,
        **scale,  # the inference pool's: the experiment's scale subresource scales it
        "conditions": [
            condition("SpecValid", True, "ValidWithWarnings" if warnings else "Valid", "; ".join(warnings),
                      generation),
            condition("Ready", phase == Phase.RUNNING,
                      "Running" if phase == Phase.RUNNING else QUEUED if queued else phase.value,
                      f"inference {pool_phase or 'Pending'}, trainer {job_phase or 'Pending'}"
                      + ("; waiting for Kueue to admit the experiment's pod group" if queued else ""), generation),
            degraded,
        ],
    }


def invalid_spec_status(generation: int | None, message: str) -> Manifest:
    """Status of an experiment whose spec breaks a rule: no children, the field named."""
    return {
        "phase": Phase.FAILED.value,
        "observedGeneration": generation,
        "conditions": [
            condition("SpecValid", False, "InvalidSpec", message, generation),
            condition("Ready", False, "InvalidSpec", "no children were created", generation),
        ],
    }


def child_conflict_status(generation: int | None, message: str) -> Manifest:
    """Status of an experiment one of whose children's names is taken by an object it does not own:
    nothing of the other object is adopted or changed; renaming or removing it resolves this."""
    return {
        "phase": Phase.PENDING.value,
        "observedGeneration": generation,
        "conditions": [
            condition("Ready", False, "ChildNameTaken", message, generation),
            condition("Degraded", True, "ChildNameTaken", message, generation),
        ],
    }


def without_times(status: Manifest) -> Manifest:
    """Status minus transition times, to tell whether a write would change anything."""
    conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return {**status, "conditions": conds}


def reconcile_error_status(old: Manifest, reason: str, message: str, generation: int | None) -> Manifest:
    """``old`` status with ``Degraded`` = True (``reason``: why the operator cannot converge the
    object); the other conditions and fields stay as they were. The next successful sync writes the
    object's own status, and with it Degraded's real value."""
    conditions = [c for c in old.get("conditions") or [] if c.get("type") != "Degraded"]
    return {**old, "conditions": [*conditions, condition("Degraded", True, reason, message, generation)]}
