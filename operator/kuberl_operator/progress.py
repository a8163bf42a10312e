"""Training progress into ``RLExperiment.status.progress`` (the STEP / VERSION / REWARD / OBSERVED-STALENESS
columns of ``kubectl get rlx``).

Trainer rank 0 serves ``GET /progress`` (``kuberl.trainer.progress``); the operator polls it for
every experiment in phase Running and patches the status when it changed, so the workload pods
need no access to the Kubernetes API. What to poll comes from the operator's cache of what its
watches delivered (``cache.ObjectCache``: the Running experiments, rank 0's pod IP), never from a
cluster-wide list: the poller sees exactly the namespaces the operator watches. The URL is
``http://{ip}:{port}/progress`` with rank 0's pod IP (the pod binds only that address);
``KUBERL_PROGRESS_URL`` overrides it with a template using {ip}, {host} (rank 0's DNS name),
{pod}, {job}, {namespace}, {name} and {port} (an operator running outside the cluster, or tests).
Replies are capped in size (``MAX_REPLY_BYTES``) and in time — one deadline for the whole reply
(``FETCH_SECONDS``), so a trainer that drips a byte at a time cannot hold the poller — and redirects
are not followed. Every experiment is polled concurrently (at most ``CONCURRENT_FETCHES`` at once):
one slow trainer delays no other experiment's status. A Warning Event says when a weight exchange fell back to
broadcast or had a slow replica since the last poll (``push_events``: the counts in the progress grew).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from pydantic import ValidationError

from kuberl.api import API_GROUP, API_VERSION, Progress, RLExperiment
from kuberl.api.autoscale import Decision, decide
from kuberl.api.contract import (
    LABEL_JOBSET,
    PROGRESS_PORT,
    TrainerRuntime,
    trainer_job_name,
    trainer_rank0_host,
    trainer_rank0_pod,
    trainer_rank0_selector,
)
from kuberl.api.spec import AutoscaleSpec

from .children import post_event
from .kube import ApiError, Kube

log = logging.getLogger("kuberl.operator.progress")
Manifest = dict[str, Any]
DEFAULT_URL = "http://{ip}:{port}/progress"
HOST_URL = "http://{host}:{port}/progress"


def seconds_between(earlier: str | None, now: datetime) -> float | None:
    """Seconds from an RFC 3339 time (as ``status.autoscale.lastScaleTime`` records it) to ``now``; None
    without one."""
    if not earlier:
        return None
    try:
        return (now - datetime.fromisoformat(earlier.replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return None


def trainer_runtime(spec: Manifest) -> TrainerRuntime:
    return TrainerRuntime((spec.get("trainer") or {}).get("runtime") or TrainerRuntime.NATIVE)


def progress_url(experiment: str, namespace: str, ip: str | None, template: str | None = None,
                 runtime: str = TrainerRuntime.NATIVE) -> str | None:
    """Trainer rank 0's /progress (fields: see the module docstring); None while the URL needs
    rank 0's pod IP and the pod has none yet. A TrainJob's rank 0 is found by its DNS name: its pod
    (JobSet's, random-named) is not one the operator holds."""
    runtime = TrainerRuntime(runtime)
    template = template or (HOST_URL if runtime == TrainerRuntime.TRAINJOB else DEFAULT_URL)
    if "{ip}" in template and not ip:
        return None
    job = trainer_job_name(experiment)
    return template.format(ip=ip, host=trainer_rank0_host(job, namespace, runtime),
                           pod=trainer_rank0_pod(job, runtime) or "", job=job, namespace=namespace, name=experiment,
                           port=PROGRESS_PORT)


MAX_REPLY_BYTES = 64 * 1024


def progress_status(payload: Any) -> Manifest:
    """The trainer's /progress JSON → ``status.progress``: ``kuberl.api.Progress``'s wire form, any
    value that is not what its field allows left out — whatever a pod answers, the status carries
    nothing else."""
    progress = Progress.from_reply(payload)
    return progress.to_wire() if progress is not None else {}


FETCH_SECONDS = 2.0
CONCURRENT_FETCHES = 64


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float = FETCH_SECONDS) -> Manifest | None:
    """GET the progress JSON within ``timeout`` seconds in all (connect, headers and body); None
    (with the reason logged) when the trainer is not reachable yet, answers something else than
    200 (a redirect is not followed), too much, or too slowly."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                body = b""
                while len(body) <= MAX_REPLY_BYTES and (chunk := await resp.content.read(MAX_REPLY_BYTES + 1)):
                    body += chunk
        if len(body) > MAX_REPLY_BYTES:
            raise ValueError(f"reply larger than {MAX_REPLY_BYTES} bytes")
        return json.loads(body)
    except (OSError, ValueError, RecursionError, TimeoutError, aiohttp.ClientError) as err:
        log.debug("progress from %s unavailable: %r", url, err)
        return None


async def fetch_all(urls: list[str], timeout: float = FETCH_SECONDS,
                    concurrency: int = CONCURRENT_FETCHES) -> list[Manifest | None]:
    """``fetch`` every URL, ``concurrency`` at a time: the round takes about the slowest reply
    (at most ``timeout``) per ``concurrency`` experiments, not the sum of them."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, url: str) -> Manifest | None:
        async with gate:
            return await fetch(session, url, timeout)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, url) for url in urls)))


def termination_progress(pod: Manifest | None) -> Manifest | None:
    """The final progress trainer rank 0 left as its container's termination message, if any."""
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
        if message:
            try:
                payload = json.loads(message)
            except ValueError:
                return None
            return payload if isinstance(payload, dict) else None
    return None


async def final_progress(kube: Kube, namespace: str, experiment: str,
                         runtime: str = TrainerRuntime.NATIVE) -> Manifest | None:
    """``status.progress`` from trainer rank 0's termination message (it has exited: nothing to poll).
    Read from the API server, not a cache: this is read once, when the experiment turns Succeeded,
    and the pod's last status may not have come through the watch yet. A TrainJob's rank 0 is the
    pod of completion index 0 of its JobSet (selected by labels: JobSet names it at random)."""
    job = trainer_job_name(experiment)
    name = trainer_rank0_pod(job, runtime)
    if name is not None:
        pod = await kube.read("v1", "Pod", namespace, name)
    else:
        selector = {**trainer_rank0_selector(experiment, runtime), LABEL_JOBSET: job}
        pod = next(iter(await kube.read_list("v1", "Pod", namespace, selector)), None)
    payload = termination_progress(pod)
    return progress_status(payload) if payload else None


@dataclass(frozen=True)
class Target:
    """One running experiment to poll."""

    namespace: str
    name: str
    runtime: TrainerRuntime
    progress: Manifest | None  # status.progress as last seen
    autoscale: AutoscaleSpec | None = None  # spec.inference.autoscale
    replicas: int | None = None  # spec.inference.replicas, else the pool's (status.replicas)
    last_scale: str | None = None  # status.autoscale.lastScaleTime
    too_few: int | None = None  # status.autoscale.tooFew


def autoscale_of(inference: Manifest) -> AutoscaleSpec | None:
    """``spec.inference.autoscale`` as its model; None when unset — or invalid: a spec the reconcile
    refuses (and reports on the experiment's conditions) is never autoscaled."""
    try:
        return AutoscaleSpec.model_validate(inference["autoscale"]) if inference.get("autoscale") else None
    except ValidationError:
        return None


def running_target(namespace: str, name: str, spec: Manifest, status: Manifest) -> Target | None:
    """What to poll for an RLExperiment: a Target while it is Running, else None."""
    status = status or {}
    if status.get("phase") != "Running":
        return None
    inference = (spec or {}).get("inference") or {}
    autoscaled = status.get("autoscale") or {}
    return Target(namespace, name, trainer_runtime(spec), status.get("progress"), autoscale_of(inference),
                  inference.get("replicas") or status.get("replicas"), autoscaled.get("lastScaleTime"),
                  autoscaled.get("tooFew"))


PodIp = Callable[[str, str], str | None]  # (namespace, pod name) → its IP, None while it has none


async def poll_once(kube: Kube, targets: Iterable[Target], pod_ip: PodIp, template: str | None = None) -> int:
    """Update every target whose progress changed; returns how many were patched. One experiment's
    unreachable or slow trainer, or failed write, never costs the others their update."""
    polled: list[tuple[Target, str]] = []
    for target in targets:
        rank0 = trainer_rank0_pod(trainer_job_name(target.name), target.runtime)
        ip = pod_ip(target.namespace, rank0) if rank0 is not None else None
        url = progress_url(target.name, target.namespace, ip, template, target.runtime)
        if url:
            polled.append((target, url))
    changed = []
    for (target, _), payload in zip(polled, await fetch_all([url for _, url in polled]), strict=True):
        progress = progress_status(payload) if payload is not None else {}
        if progress and progress != target.progress:
            changed.append((target, progress))
    patched = await write_progress(kube, changed)
    at = datetime.now(UTC)
    for target, progress in changed:
        for reason, message in push_events(target.progress, progress):
            await post_event(kube, involved_of(target), reason, message)
        if target.autoscale and target.replicas:
            decision = decide(target.replicas, progress.get("rolloutWaitFraction"), target.autoscale,
                              seconds_between(target.last_scale, at), target.too_few)
            if decision is not None:
                await write_scale(kube, target, decision, at.strftime("%Y-%m-%dT%H:%M:%SZ"))
    return patched


def involved_of(target: Target) -> Manifest:
    """The experiment an Event is about."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": RLExperiment.KIND,
            "metadata": {"name": target.name, "namespace": target.namespace}}


PUSH_EVENTS = (("pushesFellBack", "WeightSyncFellBack", "fell back to broadcast (p2p could not carry them)"),
               ("pushesSlowReplica", "WeightSyncSlowReplica", "had a replica ≥ 2× the median time of the others"))


def push_events(before: Manifest | None, after: Manifest) -> list[tuple[str, str]]:
    """The Warning Events (reason, message) of the weight exchanges between two progress reports:
    ``WeightSyncFellBack`` when ``pushesFellBack`` grew, ``WeightSyncSlowReplica`` when ``pushesSlowReplica``
    did; each message ends with the last push's account (version, way, seconds, why it fell back, the slowest
    replica)."""
    last = after.get("lastPush") or {}
    account = (f"the last: version {last.get('version')} by {last.get('mode')} in {last.get('seconds')} s"
               + (f", fell back: {last.get('reason')}" if last.get("fellBack") else "")
               + (f", slowest replica {last.get('slowestReplica')} at {last.get('slowestRatio')}× the median"
                  if last.get("slowestReplica") else ""))
    events = []
    for key, reason, what in PUSH_EVENTS:
        grew = (after.get(key) or 0) - ((before or {}).get(key) or 0)
        if grew > 0:
            events.append((reason, f"{grew} weight exchange(s) {what} since the last report; {account}"))
    return events


async def write_scale(kube: Kube, target: Target, decision: Decision, at: str) -> None:
    """The autoscaler's decision: ``spec.inference.replicas`` (through the scale subresource, as
    ``kubectl scale`` and an HPA write it; the
    experiment's sync resizes its pool and the trainer follows), ``status.autoscale`` and a Normal
    Event. A write that fails is logged; the next step's progress decides again."""
    version = f"{API_GROUP}/{API_VERSION}"
    try:
        await kube.patch(version, RLExperiment.KIND, target.namespace, target.name,
                         {"spec": {"replicas": decision.replicas}}, "scale")  # least privilege: as an HPA
        await kube.patch(version, RLExperiment.KIND, target.namespace, target.name,
                         {"status": {"autoscale": {"replicas": decision.replicas, "lastScaleTime": at,
                                                   "reason": decision.reason[:256],
                                                   "tooFew": decision.too_few}}}, "status")  # None: forgotten
    except ApiError as err:
        log.warning("autoscale of %s/%s to %d replicas not written (%s)", target.namespace, target.name,
                    decision.replicas, err.status)
        return
    log.info("autoscale %s/%s: %s → %d replicas (%s)", target.namespace, target.name, target.replicas,
             decision.replicas, decision.reason)
    await post_event(kube, involved_of(target), "Autoscaled",
                     f"{target.replicas} → {decision.replicas} inference replicas: {decision.reason}", "Normal")


async def write_progress(kube: Kube, changed: list[tuple[Target, Manifest]]) -> int:
    """Patch each experiment's ``status.progress``; returns how many were written."""
    patched = 0
    for target, progress in changed:
        try:
            await kube.patch(f"{API_GROUP}/{API_VERSION}", RLExperiment.KIND, target.namespace, target.name,
                       {"status": {"progress": progress}}, "status")
        except ApiError as err:
            if err.status != 404:  # 404: deleted since, nothing to report on
                log.warning("progress of %s/%s not written (%s); retried next round", target.namespace,
                            target.name, err.status)
            continue
        patched += 1
    return patched


async def poll_forever(kube: Kube, interval: float, targets: Callable[[], list[Target]], pod_ip: PodIp,
                       template: str | None = None) -> None:
    """``poll_once`` every ``interval`` seconds until cancelled, over what ``targets`` returns then
    (read on the event loop), with the URL ``template`` (``progress_url``); a failed round is logged
    and retried."""
    while True:
        try:
            await poll_once(kube, targets(), pod_ip, template)
        except Exception:
            log.exception("progress polling failed; retrying in %.0fs", interval)
        await asyncio.sleep(interval)
