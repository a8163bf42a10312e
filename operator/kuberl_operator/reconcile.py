"""Level-triggered reconciliation: read the object, converge its children, write its status.

Each ``sync_*`` function is idempotent and safe to run any number of times, from any event, in
any order, and after an operator restart: children have deterministic names and are created
only when absent, so nothing is ever duplicated. ``spec`` of the reconciled object is never
written; only its children and its ``status``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from kuberl.api import GROUP_VERSION, InferencePool, RLExperiment, TrainerJob
from kuberl.api.contract import (
    agent_deployment_name,
    agent_token_secret_name,
    checkpoint_key_secret_name,
    gateway_service_name,
    inference_pool_name,
    trainer_job_name,
)
from kuberl.api.resolve import cluster_warnings
from kuberl.api.spec import TrainerRuntime
from kuberl.api.storage import standalone_issues
from kuberl.api.validation import schema_issues

from . import postmortem, trainer_runtimes
from .builders import build_experiment_children, build_inference_children, build_trainer_children
from .builders.access import token_version
from .builders.experiment import InvalidSpec, check_experiment, tenancy_issues
from .builders.inference import pool_selector
from .children import NotOurs, converge_pods, delete_owned, ensure_api_token, ensure_in_stages, write_status
from .kube import Kube, Manifest
from .progress import final_progress
from .settings import DEFAULT_BUILD, BuildSettings
from .status import (
    child_conflict_status,
    condition,
    experiment_status,
    invalid_spec_status,
    job_status,
    pool_status,
    reconcile_error_status,
)
from .topology import missing_topology, topology_labels

log = logging.getLogger("kuberl.operator")


async def prune_agent(kube: Kube, body: Manifest, experiment: str) -> None:
    """spec.agent removed: its Deployment, the gateway's Service and the agent token Secret go too."""
    await delete_owned(kube, body, "apps/v1", "Deployment", agent_deployment_name(experiment))
    await delete_owned(kube, body, "v1", "Service", gateway_service_name(experiment))
    await delete_owned(kube, body, "v1", "Secret", agent_token_secret_name(experiment))


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


async def _validated(kube: Kube, kind: type[InferencePool] | type[TrainerJob], body: Manifest,
                     settings: BuildSettings) -> Any:
    """The pool or job as a model; None (with an InvalidSpec status naming the field) when its spec
    breaks the schema (a standalone object the CRD would have refused, or one from an older schema)
    or names an experiment it is not a child of (``claim_problem``) or another object's managed Secrets
    (``standalone_issues``), or a queue or PriorityClass its namespace may not use (``tenancy_issues``)."""
    try:
        model = kind.model_validate(body)
        refused = standalone_issues(model.spec, model.metadata.name) + tenancy_issues(
            model.spec.scheduling, model.metadata.namespace, settings)
        message = "; ".join(map(str, refused)) if refused else await claim_problem(kube, body, model.spec.experiment)
    except ValidationError as err:
        model, message = None, "; ".join(str(i) for i in schema_issues(err, kind))
    if message is None:
        return model
    await write_status(kube, body, invalid_spec_status(body["metadata"].get("generation"), message))
    log.warning("%s %s/%s is invalid: %s", kind.KIND, body["metadata"].get("namespace"), body["metadata"]["name"],
                message)
    return None


Model = InferencePool | TrainerJob
Converge = Callable[[Any, Manifest, str], Awaitable[None]]  # (the model, its body, its token version)


async def _sync_child(kube: Kube, kind: type[InferencePool] | type[TrainerJob], namespace: str, name: str,
                      converge: Converge, settings: BuildSettings) -> Manifest | None:
    """A pool's or job's sync, the steps they share: read it (None: gone or going), validate it (an
    InvalidSpec status and nothing else when it is not valid), its own API token when it stands
    alone (an experiment's child carries the experiment's in its configRevision), then ``converge``
    its children and status; a child whose name is taken is reported, nothing else touched."""
    body = await kube.get(GROUP_VERSION, kind.KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    model = await _validated(kube, kind, body, settings)
    if model is None:
        return body
    try:
        version = "" if model.spec.experiment else token_version(await ensure_api_token(kube, body, name))
        await converge(model, body, version)
    except NotOurs as err:
        await _report_conflict(kube, body, err)
    return body


async def sync_pool(kube: Kube, namespace: str, name: str, settings: BuildSettings = DEFAULT_BUILD) -> Manifest | None:
    async def converge(pool: InferencePool, body: Manifest, version: str) -> None:
        children = build_inference_children(pool, body, version, settings)
        pods = await converge_pods(kube, body, children, pool_selector(pool), gang=False)
        status = pool_status(body["spec"], body["metadata"].get("generation"), pods, pool_selector(pool))
        await write_status(kube, body, status)

    return await _sync_child(kube, InferencePool, namespace, name, converge, settings)


async def sync_job(kube: Kube, namespace: str, name: str, settings: BuildSettings = DEFAULT_BUILD) -> Manifest | None:
    async def converge(job: TrainerJob, body: Manifest, version: str) -> None:
        if not job.spec.experiment:  # an experiment's job reads the experiment's key
            await ensure_api_token(kube, body, name, checkpoint_key_secret_name(name))
        children = build_trainer_children(job, body, version, settings)
        runtime = TrainerRuntime(job.spec.runtime)
        leftover = await trainer_runtimes.retire_other_runtimes(kube, body, job, runtime)
        generation = body["metadata"].get("generation")
        if leftover is not None:
            status = job_status(body["spec"], generation, [], (body.get("status") or {}).get("restarts", 0))
            status["conditions"].append(condition("RuntimeSwitch", True, "OldGangStopping", (
                f"trainer.runtime is now {job.spec.runtime}: waiting for {leftover} of the old runtime to go "
                "(one gang at a time: both would write the same checkpoints)"), generation))
            await write_status(kube, body, status)
        elif runtime in trainer_runtimes.EXTERNAL_RUNTIMES:
            await trainer_runtimes.sync_external_job(kube, body, children, runtime)
        else:
            await trainer_runtimes.sync_native_job(kube, body, job, children)

    return await _sync_child(kube, TrainerJob, namespace, name, converge, settings)


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
        check_experiment(exp, settings)  # nothing is created for an invalid spec
    except ValidationError as err:
        message = "; ".join(str(i) for i in schema_issues(err, RLExperiment))
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
    Succeeded, with the final progress; on turning Failed, with its post-mortem (``postmortem.record``)."""
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    status = experiment_status(
        body["metadata"].get("generation"), exp.spec.suspend,
        (pool["metadata"]["name"], pool.get("status")),
        (job["metadata"]["name"], job.get("status")),
        tuple(str(w) for w in cluster_warnings(exp.spec)),
    )
    before = (body.get("status") or {}).get("phase")
    if status["phase"] == "Succeeded" and before != "Succeeded":
        # The trainer has exited, so there is no endpoint left to poll: the final step and reward
        # come from rank 0's termination message, in the same write that says Succeeded.
        final = await final_progress(kube, namespace, name, exp.spec.trainer.runtime)
        if final:
            status["progress"] = final
    status = {**(body.get("status") or {}), **status}
    if status["phase"] == "Failed" and before != "Failed":  # before the pods that say why are gone
        status["postmortem"] = await postmortem.record(kube, {**body, "status": status}, "Failed")
    await write_status(kube, body, status)


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
