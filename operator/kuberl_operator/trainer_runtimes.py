"""A TrainerJob's gang, by ``trainer.runtime``: our own rank pods (``native``: converged, and restarted
as a whole when a rank fails — counted against backoffLimit — or the cluster takes one — a preemption,
not counted), or the object of a runtime whose controller makes the pods (``kubeflow``: a PyTorchJob;
``trainjob``: a TrainJob), whose status the TrainerJob's follows. A runtime switch retires the old
gang before the new one starts (``retire_other_runtimes``).
"""

from __future__ import annotations

import logging

from kuberl.api import TrainerJob
from kuberl.api.spec import TrainerRuntime, restart_limit

from .builders.kubeflow import PYTORCHJOB_API_VERSION, TRAINER_API_VERSION
from .builders.trainer import job_selector
from .children import converge_pods, delete_owned, ensure, owned_pods, prune_pods, template_changed, write_status
from .kube import ApiError, Kube, Manifest
from .status import condition, gang_restart, job_status, pytorchjob_status, trainjob_status

log = logging.getLogger("kuberl.operator")


# The runtimes whose controller makes the pods: the object kind each gets, and its status function.
EXTERNAL_RUNTIMES = {
    TrainerRuntime.KUBEFLOW: (PYTORCHJOB_API_VERSION, "PyTorchJob", pytorchjob_status),
    TrainerRuntime.TRAINJOB: (TRAINER_API_VERSION, "TrainJob", trainjob_status),
}


async def retire_other_runtimes(kube: Kube, body: Manifest, job: TrainerJob, runtime: TrainerRuntime) -> str | None:
    """After a ``trainer.runtime`` switch: delete what the other runtimes made for this job (our own
    rank pods, our PyTorchJob or TrainJob — deleted in the foreground, so it stays until its pods are
    gone) and say what is still there (None: nothing, the new gang may start). Run every sync, so a
    switch back and forth also ends with one gang."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    left = []
    if runtime != TrainerRuntime.NATIVE:
        native = await owned_pods(kube, body, job_selector(job))
        await prune_pods(kube, body, job_selector(job), keep=set())  # every rank pod we made goes
        left += [f"{len(native)} rank pod(s)"] if native else []
    for other, (api_version, kind, _) in EXTERNAL_RUNTIMES.items():
        if other == runtime:
            continue
        try:
            if await delete_owned(kube, body, api_version, kind, name, foreground=True):
                left.append(f"{kind} {name}")
                continue
        except ApiError as err:
            if err.status not in (403, 404):
                raise  # 403/404: no RBAC for the kind or no CRD (its integration is off), so we made none
        pods = [p for p in await kube.list("v1", "Pod", namespace, job_selector(job))
                if any(r.get("kind") == kind and r.get("name") == name and r.get("controller")
                       for r in p["metadata"].get("ownerReferences") or [])]
        left += [f"{len(pods)} {kind} pod(s)"] if pods else []
    return ", ".join(left) or None


async def sync_external_job(kube: Kube, body: Manifest, children: list[Manifest], runtime: TrainerRuntime) -> None:
    """Kubeflow's training operator (a PyTorchJob) or Kubeflow Trainer (a TrainJob) owns the pods and
    restarts them (runPolicy.backoffLimit, the runtime's failure policy); the TrainerJob's status
    follows the object's own status."""
    api_version, kind, status_of = EXTERNAL_RUNTIMES[runtime]
    stored = {c["kind"]: await ensure(kube, c) for c in children}
    desired = next(c for c in children if c["kind"] == kind)
    if template_changed(stored[kind], desired):  # its pods cannot be patched: a new one, from the checkpoint
        meta = desired["metadata"]
        await kube.delete(api_version, kind, meta.get("namespace"), meta["name"])
        log.info("replacing %s/%s: its template changed", kind, meta["name"])
        return
    status = status_of(body["spec"], body["metadata"].get("generation"), stored.get(kind),
                       (body.get("status") or {}).get("restarts", 0))
    await write_status(kube, body, status)


async def sync_native_job(kube: Kube, body: Manifest, job: TrainerJob, children: list[Manifest]) -> None:
    """Our own rank pods: converge them, restart the whole gang when a rank failed or the cluster took
    one (preempted, evicted, drained: not counted against backoffLimit), report status."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    generation = body["metadata"].get("generation")
    before = body.get("status") or {}
    restarts, preemptions = before.get("restarts", 0), before.get("preemptions", 0)
    acknowledged = list(before.get("disruptedPods") or [])
    pods = await converge_pods(kube, body, children, job_selector(job), gang=True)  # a failed pod keeps its name
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    limit = restart_limit(job.spec.backoff_limit)
    restart = gang_restart(pods, restarts, limit, frozenset(acknowledged))
    if restart is not None:
        if restart.preempted:
            preemptions += 1
            acknowledged += list(restart.disrupted)
            told = f"{restart.reason}; preemption {preemptions}, restarting from the last checkpoint (not a failure: " \
                   f"backoffLimit not used)"
        else:
            restarts += 1
            told = f"{restart.reason}; restart {restarts}/{limit} from the last checkpoint"
        status = job_status(body["spec"], generation, [], restarts, preemptions, acknowledged)
        status["conditions"].append(condition(
            "GangRestarted", True, "Preempted" if restart.preempted else "RankFailed", told, generation))
        await write_status(kube, body, status)  # counted first: a lost race (409) raises before any pod is deleted
        for pod in live:  # the next sync (on their deletion) recreates them; ranks resume from the checkpoint
            await kube.delete("v1", "Pod", namespace, pod["metadata"]["name"])
        log.warning("TrainerJob %s/%s: %s; restarting every rank", namespace, name, told)
        return
    status = job_status(body["spec"], generation, live, restarts, preemptions, acknowledged)  # deleted ranks: gone
    status["conditions"] += [c for c in before.get("conditions") or []
                             if c.get("type") == "GangRestarted"]  # the last restart stays visible
    await write_status(kube, body, status)
