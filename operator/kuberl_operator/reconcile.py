"""Level-triggered reconciliation: read the object, converge its children, write its status.

Each ``sync_*`` function is idempotent and safe to run any number of times, from any event, in
any order, and after an operator restart: children have deterministic names and are created
only when absent, so nothing is ever duplicated. ``spec`` of the reconciled object is never
written; only its children and its ``status``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from typing import Any

from pydantic import ValidationError

from kuberl.api import API_GROUP, GROUP_VERSION, InferencePool, RLExperiment, TrainerJob
from kuberl.api.contract import (
    ANNOTATION_TEMPLATE_HASH,
    agent_deployment_name,
    agent_token_secret_name,
    checkpoint_key_secret_name,
    gateway_service_name,
    inference_pool_name,
    trainer_job_name,
)
from kuberl.api.spec import TrainerRuntime
from kuberl.api.validation import schema_issues

from .builders import build_experiment_children, build_inference_children, build_trainer_children
from .builders.access import api_token_secret, token_version
from .builders.experiment import InvalidSpec, check_experiment
from .builders.inference import pool_selector
from .builders.kubeflow import PYTORCHJOB_API_VERSION, TRAINER_API_VERSION
from .builders.trainer import job_selector
from .kube import ApiError, Kube, Manifest
from .patch import merge_patch_to, overlay_patch_to
from .progress import final_progress
from .replacement import pods_to_replace
from .settings import DEFAULT_BUILD, BuildSettings
from .status import (
    child_conflict_status,
    condition,
    experiment_status,
    gang_restart,
    invalid_spec_status,
    job_status,
    merge_conditions,
    pool_status,
    pytorchjob_status,
    reconcile_error_status,
    trainjob_status,
    without_times,
)
from .topology import missing_topology, topology_labels

log = logging.getLogger("kuberl.operator")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NotOurs(RuntimeError):
    """A child's name is taken by an object its parent does not control."""


def _controller_uid(meta: Manifest) -> str | None:
    return next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


async def ensure(kube: Kube, obj: Manifest, new_owner: bool = False) -> Manifest:
    """Create ``obj`` if absent; bring an existing object's spec or data in line (``_updated_field``;
    a merge patch that also removes the fields the desired object no longer has).
    Raises NotOurs (and touches nothing) when the existing object is controlled by another owner
    or by none: a user's ConfigMap that happens to carry the name is never adopted or rewritten.
    ``new_owner``: the owner was never synced (it has no status), so ``obj`` is almost surely absent:
    create it without reading first (a read the cache cannot answer costs a round trip); a 409 reads."""
    meta = obj["metadata"]
    key = (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    existing = None if new_owner else await kube.get(*key)
    if existing is None:
        try:
            created = await kube.create(obj)
            log.debug("created %s/%s", obj["kind"], meta["name"])  # routine: ~10 per experiment
            return created
        except ApiError as err:
            if err.status != 409:
                raise
            existing = await kube.read(*key)  # it exists, whatever a cache says
            if existing is None:
                raise
    owner = _controller_uid(meta)
    if owner is not None and _controller_uid(existing["metadata"]) != owner:
        raise NotOurs(f"{obj['kind']} {meta['name']!r} already exists and is not controlled by "
                      f"{meta['ownerReferences'][0]['kind']} {meta['ownerReferences'][0]['name']!r}; rename or "
                      "remove it")
    field = _updated_field(obj)
    if field is not None and existing.get(field) != obj.get(field):
        compute = overlay_patch_to if obj["kind"] in SERVER_DEFAULTED else merge_patch_to
        patch = compute(existing.get(field) or {}, obj.get(field) or {})
        if patch != {}:
            existing = await kube.patch(*key, {field: patch})
            log.debug("updated %s/%s %s", obj["kind"], meta["name"], field)
    return existing


SERVER_DEFAULTED = ("Deployment",)


def _updated_field(obj: Manifest) -> str | None:
    """What ``ensure`` keeps in line with the desired object: a custom resource's, NetworkPolicy's or
    Deployment's spec (a Deployment's only in the fields we set: the API server defaults the rest), a
    ConfigMap's data. Secrets (the API token) and Services are only ever created; pods are replaced,
    never patched (``prune_pods``)."""
    if obj["apiVersion"].startswith(f"{API_GROUP}/") or obj["kind"] in ("NetworkPolicy", *SERVER_DEFAULTED):
        return "spec"
    return "data" if obj["kind"] == "ConfigMap" else None


async def ensure_api_token(kube: Kube, owner: Manifest, experiment: str, name: str | None = None) -> Manifest:
    """The experiment's API token Secret (docs/architecture.md, "Who may call what"), or its Secret
    ``name`` of the same shape (the agent's token, the checkpoint key): created once with 32 fresh
    random bytes, owned by ``owner``, never rewritten while it exists; returned as stored (a token's
    version: ``access.token_version``)."""
    secret = api_token_secret(owner, experiment, secrets.token_urlsafe(32), name)
    return await ensure(kube, secret, new_owner=not owner.get("status"))


async def delete_owned(kube: Kube, parent: Manifest, api_version: str, kind: str, name: str,
                       foreground: bool = False) -> bool:
    """Delete ``parent``'s child ``kind``/``name`` if it exists and ``parent`` controls it (what a
    removed spec field created); returns whether it was there (``foreground``: ``Kube.delete``'s).
    Another owner's object is left alone."""
    namespace = parent["metadata"].get("namespace")
    child = await kube.get(api_version, kind, namespace, name)
    if child is None or _controller_uid(child["metadata"]) != parent["metadata"].get("uid"):
        return False
    if not child["metadata"].get("deletionTimestamp"):
        await kube.delete(api_version, kind, namespace, name, foreground)
        log.info("deleted %s/%s: its spec field is gone", kind, name)
    return True


async def prune_agent(kube: Kube, body: Manifest, experiment: str) -> None:
    """spec.agent removed: its Deployment, the gateway's Service and the agent token Secret go too."""
    await delete_owned(kube, body, "apps/v1", "Deployment", agent_deployment_name(experiment))
    await delete_owned(kube, body, "v1", "Service", gateway_service_name(experiment))
    await delete_owned(kube, body, "v1", "Secret", agent_token_secret_name(experiment))


def _template_changed(stored: Manifest, desired: Manifest) -> bool:
    old, new = ((o["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH) for o in (stored, desired))
    return old is not None and new is not None and old != new


async def prune_pods(kube: Kube, parent: Manifest, selector: dict[str, str], keep: set[str]) -> None:
    """Delete ``parent``'s pods matching ``selector`` whose names are not in ``keep`` (suspend,
    scale-down); pods someone else controls are left alone, whatever their labels say."""
    namespace = parent["metadata"].get("namespace")
    for pod in await kube.list("v1", "Pod", namespace, selector):
        name = pod["metadata"]["name"]
        if _controller_uid(pod["metadata"]) != parent["metadata"].get("uid"):
            continue
        if name not in keep and not pod["metadata"].get("deletionTimestamp"):
            await kube.delete("v1", "Pod", namespace, name)
            log.info("deleted Pod/%s", name)


async def write_status(kube: Kube, obj: Manifest, status: Manifest) -> bool:
    """Patch ``status`` only when it changed (a no-op write would wake every watcher; returns
    whether it wrote), and only if ``obj`` is still current: two syncs of one object can race (its
    own event and a child's), and the one that read an older version must not overwrite the newer
    one's status. The loser gets 409 Conflict, which it raises: its sync is retried on fresh state
    (``handlers.sync_object``) and nothing after the write happens in the lost one."""
    old = obj.get("status") or {}
    status = {**status, "conditions": merge_conditions(old.get("conditions") or [], status["conditions"], now())}
    if without_times({**old, **status}) == without_times(old):
        return False
    meta = obj["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
    await kube.patch(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], patch, "status")
    return True


async def _owned_pods(kube: Kube, parent: Manifest, selector: dict[str, str]) -> list[Manifest]:
    pods = await kube.list("v1", "Pod", parent["metadata"].get("namespace"), selector)
    return [p for p in pods if _controller_uid(p["metadata"]) == parent["metadata"].get("uid")]


POD_BATCH = 64


async def _converge(kube: Kube, parent: Manifest, children: list[Manifest], selector: dict[str, str],
                    gang: bool) -> list[Manifest]:
    """Create what is missing, prune pods no longer wanted, replace pods whose template changed
    (``replacement``: the whole gang, or one replica at a time); returns ``parent``'s pods. The
    pods are created ``POD_BATCH`` at a time, concurrently (independent of each other; the client
    bounds what is in flight), after the other children, in order."""
    pods_wanted = [c for c in children if c["kind"] == "Pod"]
    for child in children:
        if child["kind"] != "Pod":
            await ensure(kube, child)
    for start in range(0, len(pods_wanted), POD_BATCH):
        await asyncio.gather(*(ensure(kube, pod) for pod in pods_wanted[start:start + POD_BATCH]))
    desired = {c["metadata"]["name"]: (c["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH, "")
               for c in pods_wanted}
    await prune_pods(kube, parent, selector, set(desired))
    pods = await _owned_pods(kube, parent, selector)
    doomed = pods_to_replace(desired, pods, gang)
    for name in doomed:  # the next sync (on their deletion) recreates them from the new template
        await kube.delete("v1", "Pod", parent["metadata"].get("namespace"), name)
        log.info("replacing Pod/%s: its template changed", name)
    return await _owned_pods(kube, parent, selector) if doomed else pods


async def _report_conflict(kube: Kube, body: Manifest, err: NotOurs) -> None:
    meta = body["metadata"]
    await write_status(kube, body, child_conflict_status(meta.get("generation"), str(err)))
    log.warning("%s %s/%s: %s", body["kind"], meta.get("namespace"), meta["name"], err)


async def claim_problem(kube: Kube, body: Manifest, experiment: str | None) -> str | None:
    """Why a pool or job may not act for ``experiment`` (its ``spec.experiment``), or None when it may:
    only the experiment's own child — named as the experiment names its pool or job, its controller
    owner reference naming that RLExperiment with the uid it has now — gets the experiment's label,
    network admission and token. A free-text field never links a user's object to someone else's
    experiment (and the child's name is taken: a copy cannot have it)."""
    if not experiment:
        return None
    meta = body["metadata"]
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), {})
    own_name = inference_pool_name(experiment) if body["kind"] == InferencePool.KIND else trainer_job_name(experiment)
    if meta["name"] == own_name and owner.get("kind") == RLExperiment.KIND and owner.get("name") == experiment:
        key = (GROUP_VERSION, RLExperiment.KIND, meta.get("namespace"), experiment)
        current = await kube.get(*key) or await kube.read(*key)  # the cache may not hold it yet (a restart)
        if current is not None and current["metadata"].get("uid") == owner.get("uid"):
            return None
    return (f"spec.experiment: {experiment!r} is set by an RLExperiment on the pool and job it creates; this "
            f"{body['kind']} is not a child of it (leave spec.experiment unset for a standalone one)")


async def _validated(kube: Kube, kind: type[InferencePool] | type[TrainerJob], body: Manifest) -> Any:
    """The pool or job as a model; None (with an InvalidSpec status naming the field) when its spec
    breaks the schema (a standalone object the CRD would have refused, or one from an older schema)
    or names an experiment it is not a child of (``claim_problem``)."""
    try:
        model = kind.model_validate(body)
        message = await claim_problem(kube, body, model.spec.experiment)
    except ValidationError as err:
        model, message = None, "; ".join(str(i) for i in schema_issues(err))
    if message is None:
        return model
    await write_status(kube, body, invalid_spec_status(body["metadata"].get("generation"), message))
    log.warning("%s %s/%s is invalid: %s", kind.KIND, body["metadata"].get("namespace"), body["metadata"]["name"],
                message)
    return None


async def sync_pool(kube: Kube, namespace: str, name: str, settings: BuildSettings = DEFAULT_BUILD) -> Manifest | None:
    body = await kube.get(GROUP_VERSION, InferencePool.KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    pool = await _validated(kube, InferencePool, body)
    if pool is None:
        return body
    try:  # on its own, its pods read a token of their own (an experiment's child: in its configRevision)
        version = "" if pool.spec.experiment else token_version(await ensure_api_token(kube, body, name))
        children = build_inference_children(pool, body, version, settings)
        pods = await _converge(kube, body, children, pool_selector(pool), gang=False)
    except NotOurs as err:
        await _report_conflict(kube, body, err)
        return body
    await write_status(kube, body, pool_status(body["spec"], body["metadata"].get("generation"), pods))
    return body


async def sync_job(kube: Kube, namespace: str, name: str, settings: BuildSettings = DEFAULT_BUILD) -> Manifest | None:
    body = await kube.get(GROUP_VERSION, TrainerJob.KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    job = await _validated(kube, TrainerJob, body)
    if job is None:
        return body
    try:
        version = "" if job.spec.experiment else token_version(await ensure_api_token(kube, body, name))
        if not job.spec.experiment:  # an experiment's job reads the experiment's key
            await ensure_api_token(kube, body, name, checkpoint_key_secret_name(name))
        children = build_trainer_children(job, body, version, settings)
        runtime = TrainerRuntime(job.spec.runtime)
        leftover = await retire_other_runtimes(kube, body, job, runtime)
        if leftover is not None:
            status = job_status(body["spec"], body["metadata"].get("generation"), [],
                                (body.get("status") or {}).get("restarts", 0))
            status["conditions"].append(condition("RuntimeSwitch", True, "OldGangStopping", (
                f"trainer.runtime is now {job.spec.runtime}: waiting for {leftover} of the old runtime to go "
                "(one gang at a time: both would write the same checkpoints)"), body["metadata"].get("generation")))
            await write_status(kube, body, status)
        elif runtime in EXTERNAL_RUNTIMES:
            await _sync_external_job(kube, body, children, runtime)
        else:
            await _sync_native_job(kube, body, job, children)
    except NotOurs as err:
        await _report_conflict(kube, body, err)
    return body


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
        native = await _owned_pods(kube, body, job_selector(job))
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


async def _sync_external_job(kube: Kube, body: Manifest, children: list[Manifest], runtime: TrainerRuntime) -> None:
    """Kubeflow's training operator (a PyTorchJob) or Kubeflow Trainer (a TrainJob) owns the pods and
    restarts them (runPolicy.backoffLimit, the runtime's failure policy); the TrainerJob's status
    follows the object's own status."""
    api_version, kind, status_of = EXTERNAL_RUNTIMES[runtime]
    stored = {c["kind"]: await ensure(kube, c) for c in children}
    desired = next(c for c in children if c["kind"] == kind)
    if _template_changed(stored[kind], desired):  # its pods cannot be patched: a new one, from the checkpoint
        meta = desired["metadata"]
        await kube.delete(api_version, kind, meta.get("namespace"), meta["name"])
        log.info("replacing %s/%s: its template changed", kind, meta["name"])
        return
    status = status_of(body["spec"], body["metadata"].get("generation"), stored.get(kind),
                       (body.get("status") or {}).get("restarts", 0))
    await write_status(kube, body, status)


async def _sync_native_job(kube: Kube, body: Manifest, job: TrainerJob, children: list[Manifest]) -> None:
    """Our own rank pods: converge them, restart the whole gang when a rank failed or the cluster took
    one (preempted, evicted, drained: not counted against backoffLimit), report status."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    generation = body["metadata"].get("generation")
    before = body.get("status") or {}
    restarts, preemptions = before.get("restarts", 0), before.get("preemptions", 0)
    acknowledged = list(before.get("disruptedPods") or [])
    pods = await _converge(kube, body, children, job_selector(job), gang=True)  # a failed pod keeps its name
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    restart = gang_restart(pods, restarts, job.spec.backoff_limit, frozenset(acknowledged))
    if restart is not None:
        if restart.preempted:
            preemptions += 1
            acknowledged += list(restart.disrupted)
            told = f"{restart.reason}; preemption {preemptions}, restarting from the last checkpoint (not a failure: " \
                   f"backoffLimit not used)"
        else:
            restarts += 1
            told = f"{restart.reason}; restart {restarts}/{job.spec.backoff_limit} from the last checkpoint"
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


STARTS_PODS = (InferencePool.KIND, TrainerJob.KIND, "Deployment")


async def ensure_in_stages(kube: Kube, children: list[Manifest]) -> dict[str, Manifest]:
    """``ensure`` an experiment's children in two stages, each stage's at once: first what its pods
    use or are fenced by (ConfigMap, NetworkPolicy, Service), then what starts pods (pool, job, the
    agent's Deployment). A child whose name is taken (``NotOurs``) stops the second stage: no pod
    starts beside a ConfigMap or a policy that is not ours. Returns the stored children by kind."""
    first = [c for c in children if c["kind"] not in STARTS_PODS]
    second = [c for c in children if c["kind"] in STARTS_PODS]
    stored: dict[str, Manifest] = {}
    for stage in (first, second):
        results = await asyncio.gather(*(ensure(kube, c) for c in stage), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raised = next((f for f in failed if isinstance(f, NotOurs)), failed[0])
            for other in failed:
                if other is not raised:  # the sync's retry ensures it again
                    log.info("%s: also failed in the same stage (%s)", type(other).__name__, other)
            raise raised
        stored.update({c["kind"]: r for c, r in zip(stage, results, strict=True)})
    return stored


async def sync_experiment(kube: Kube, namespace: str, name: str, settings: BuildSettings = DEFAULT_BUILD,
                          ) -> int | None:
    """Validate, converge the ConfigMap, InferencePool and TrainerJob, then roll their status up.
    Returns the generation it converged (None: gone, invalid, or a child's name taken)."""
    body = await kube.get(GROUP_VERSION, RLExperiment.KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = body["metadata"].get("generation")
    try:
        exp = RLExperiment.model_validate(body)
        check_experiment(exp)  # nothing is created for an invalid spec
    except ValidationError as err:
        message = "; ".join(str(i) for i in schema_issues(err))
        await write_status(kube, body, invalid_spec_status(generation, message))
        log.warning("RLExperiment %s/%s is invalid: %s", namespace, name, message)
        return None
    except InvalidSpec as err:
        await write_status(kube, body, invalid_spec_status(generation, str(err)))
        log.warning("RLExperiment %s/%s is invalid: %s", namespace, name, err)
        return None
    try:
        tokens = [await ensure_api_token(kube, body, name)]  # before the pods that read them
        await ensure_api_token(kube, body, name, checkpoint_key_secret_name(name))  # not a token: no restart on change
        if exp.spec.agent is not None:
            tokens.append(await ensure_api_token(kube, body, name, agent_token_secret_name(name)))
        elif generation != 1:  # an agent is removed by a spec change; the first spec had none to remove
            await prune_agent(kube, body, name)
        children = build_experiment_children(exp, body, settings, token_version(*tokens))
        stored = await ensure_in_stages(kube, children)
    except NotOurs as err:
        await write_status(kube, body, child_conflict_status(generation, str(err)))
        log.warning("RLExperiment %s/%s: %s", namespace, name, err)
        return None
    await _roll_up(kube, body, exp, stored[InferencePool.KIND], stored[TrainerJob.KIND])
    return generation


async def roll_up_experiment(kube: Kube, namespace: str, name: str, converged: int | None,
                             settings: BuildSettings = DEFAULT_BUILD) -> int | None:
    """The experiment's status from its pool's and job's, without converging its children: what a
    child's own status write calls for. Only when ``converged`` — the generation its last full sync
    converged — is its generation now and both children are there; otherwise the full
    ``sync_experiment``. Returns the generation converged, as that does."""
    body = await kube.get(GROUP_VERSION, RLExperiment.KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = body["metadata"].get("generation")
    if converged is None or converged != generation:
        return await sync_experiment(kube, namespace, name, settings)
    pool = await kube.get(GROUP_VERSION, InferencePool.KIND, namespace, inference_pool_name(name))
    job = await kube.get(GROUP_VERSION, TrainerJob.KIND, namespace, trainer_job_name(name))
    if pool is None or job is None:
        return await sync_experiment(kube, namespace, name, settings)
    await _roll_up(kube, body, RLExperiment.model_validate(body), pool, job)
    return generation


async def _roll_up(kube: Kube, body: Manifest, exp: RLExperiment, pool: Manifest, job: Manifest) -> None:
    """Write the experiment's status from its pool's and job's (``experiment_status``); on turning
    Succeeded, with the final progress."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    status = experiment_status(
        body["metadata"].get("generation"), exp.spec.suspend,
        (pool["metadata"]["name"], pool.get("status")),
        (job["metadata"]["name"], job.get("status")),
    )
    if status["phase"] == "Succeeded" and (body.get("status") or {}).get("phase") != "Succeeded":
        # The trainer has exited, so there is no endpoint left to poll: the final step and reward
        # come from rank 0's termination message, in the same write that says Succeeded.
        final = await final_progress(kube, namespace, name, exp.spec.trainer.runtime)
        if final:
            status["progress"] = final
    await write_status(kube, body, {**(body.get("status") or {}), **status})


async def label_pod_topology(kube: Kube, pod: Manifest) -> dict[str, Any] | None:
    """Copy the node's zone / fabric onto a freshly scheduled pod; returns the labels written."""
    node_name = missing_topology(pod)
    if node_name is None:
        return None
    node = await kube.get("v1", "Node", None, node_name)
    labels = topology_labels(node_name, ((node or {}).get("metadata") or {}).get("labels") or {})
    meta = pod["metadata"]
    await kube.patch("v1", "Pod", meta.get("namespace"), meta["name"], {"metadata": {"labels": labels}})
    return labels


async def report_failure(kube: Kube, kind: str, namespace: str, name: str, reason: str,
                         message: str) -> Manifest | None:
    """A sync failed in a way that will not heal by itself: say so on the object (``Degraded`` with
    the reason and message, other conditions kept). Returns the object (for the Event), or None if
    it is gone; a failure to write is logged, never raised (the retry is already scheduled)."""
    try:
        body = await kube.get(GROUP_VERSION, kind, namespace, name)
        if body is None:
            return None
        await write_status(kube, body, reconcile_error_status(body.get("status") or {}, reason, message,
                                                        body["metadata"].get("generation")))
    except Exception as err:
        log.warning("%s %s/%s: could not record the failure (%s)", kind, namespace, name, err)
        return None
    return body
