"""The operator's handlers: thin, level-triggered, all logic in ``reconcile``.

kopf runs the process (start-up, clean-up, log-in, liveness); the watching is the operator's own
(``informer``: one task per kind and watched namespace, pages bounded by bytes, one object at a
time — kopf's watches gave every delivered object a task holding its body, which another tenant's
look-alikes could fill). Every watched object goes to one handler (``on_object``): into the cache,
and someone else's change asks for the idempotent syncs it calls for (``routing.syncs_for``) on a
work queue. The start-up handler fills the cache first (every kind's first list, owners first) and
only then starts the syncs. The periodic safety net is the informers' re-list every
``resync_seconds``: every object is delivered again, and its syncs run again. No finalizers:
deleting an experiment never waits for the operator, owner references do the cleanup. A background
task polls each running experiment's trainer for progress (``progress.py``), reading the running
experiments and rank 0's pod IP from the cache instead of listing anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from kuberl.api import InferencePool, RLExperiment, TrainerJob
from kuberl.api.contract import LABEL_ROLE, PREFIX, ROLE_TRAINER

from . import children, kube, progress, reconcile, routing
from .cache import ON_WRITE, CachedKube, Key, ObjectCache, object_key
from .informer import Informer
from .kube import Kube, Manifest
from .ratelimit import RateLimit
from .retry import Backoff, classify, reported
from .settings import BuildSettings, OperatorSettings
from .topology import missing_topology
from .watches import CACHED_GROUPS, CACHED_KINDS, ROOT_KINDS, WATCHED
from .workqueue import WorkQueue

log = logging.getLogger("kuberl.operator")
SYNC_WORKERS = "kuberl-sync"
PROGRESS_TASK = "kuberl-progress-polling"
RETRY_TASK = "kuberl-retry-"
INFORMER_TASK = "kuberl-informer-"
LABEL_TASK = "kuberl-topology-"
SyncKey = tuple[str, str, str]


@dataclass
class OperatorState:
    """Everything the handlers share, made once at start-up (``configure``) and kept in kopf's memo
    under ``state``: the settings, the cache and the client in front of it, the sync queue and its
    per-object bookkeeping, the background tasks."""

    settings: OperatorSettings
    namespaces: list[str]  # watched; empty: the whole cluster
    cache: ObjectCache
    kube: CachedKube
    queue: WorkQueue[SyncKey]
    backoff: Backoff
    convergence: Convergence
    retries: dict[SyncKey, asyncio.Task[None]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # the informers, the progress poller
    labelling: dict[Key, asyncio.Task[None]] = field(default_factory=dict)  # pods getting their topology labels

    @property
    def scope(self) -> list[str | None]:
        """Where the start-up lists look: the watched namespaces, or None: all."""
        return list(self.namespaces or [None])


def operator_scope(namespaces: list[str] | None) -> dict[str, Any]:
    """``kopf.operator``'s arguments to watch ``namespaces`` (None or empty: the whole cluster); the
    memo tells the start-up list (``priming``) the same."""
    return {"clusterwide": not namespaces, "namespaces": list(namespaces or []),
            "memo": kopf.Memo(namespaces=list(namespaces or []))}


def _state(memo: kopf.Memo) -> OperatorState:
    return memo["state"]


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    ours = OperatorSettings.from_env()
    _tune_kopf(settings)
    cache = ObjectCache(max_age=2 * ours.resync_seconds, refresh=ours.resync_seconds / 2, roots=ROOT_KINDS,
                        groups=CACHED_GROUPS)
    client = CachedKube(lambda: kube.login(settings), cache, CACHED_KINDS, timeout=ours.api_timeout_seconds,
                        limit=RateLimit(ours.api_qps, ours.api_burst), max_in_flight=ours.api_max_in_flight,
                        secret_seconds=ours.secret_recheck_seconds)
    client.connect()  # now, not in the first sync: reading the CA bundle alone takes ~50 ms
    state = memo["state"] = OperatorState(
        ours, list(memo.get("namespaces") or []), cache, client,
        WorkQueue(lambda key: _sync_once(memo, key)),  # started by the first request_sync
        Backoff(ours.backoff_base_seconds, ours.backoff_max_seconds), Convergence())
    held = await _inform(memo)
    logger.info("Listed before the first sync: %s", ", ".join(f"{n} {kind}" for kind, n in held.items()))
    state.queue.start(ours.max_syncs, SYNC_WORKERS)  # the syncs the lists asked for, and every later one
    poller = progress.poll_forever(client, ours.progress_seconds, lambda: running_targets(cache),
                                   lambda namespace, pod: trainer_pod_ip(cache, namespace, pod), ours.progress_url)
    state.tasks.append(asyncio.get_running_loop().create_task(poller, name=PROGRESS_TASK))
    logger.info("KubeRL operator ready (full resync every %ds, progress every %.0fs)", ours.resync_seconds,
                ours.progress_seconds)


def _tune_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf runs no resource handler here (``informer`` watches): nothing for it to store on objects."""
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.posting.level = logging.WARNING
    settings.networking.error_backoffs = [1, 2, 5, 10]


async def _inform(memo: kopf.Memo) -> dict[str, int]:
    """Start an informer for each watched kind in each watched namespace (or the whole cluster), each
    kind's first list ended before the next kind's starts (``watches.WATCHED``: owners before what they
    own, so the cache knows a child's controller when the child comes; controller-runtime's
    WaitForCacheSync). The syncs these lists ask for wait in the queue until the last list has ended:
    no sync sees an experiment without the pods that existed. Returns how many of each kind are held.
    A list that fails does not stop the operator: its informer lists again, and those syncs may run first."""
    state = _state(memo)
    loop = asyncio.get_running_loop()

    def held(kind: str, namespace: str | None) -> list[Manifest]:
        return [o for o in state.cache.held(kind) if namespace is None or o["metadata"].get("namespace") == namespace]

    for watched in WATCHED:
        started = []
        for namespace in state.scope:
            informer = Informer(state.kube, watched, namespace, lambda obj, live: on_object(memo, obj, live), held,
                                state.settings.resync_seconds)
            name = f"{INFORMER_TASK}{watched.kind}/{namespace or '*'}"
            state.tasks.append(loop.create_task(informer.run(), name=name))
            started.append(informer)
        for informer in started:
            await informer.listed.wait()
    return {w.kind: n for w in WATCHED if (n := len(state.cache.held(w.kind)))}


def running_targets(cache: ObjectCache) -> list[progress.Target]:
    """What the progress poller polls: the Running experiments of the watched namespaces."""
    targets = (progress.running_target(exp["metadata"].get("namespace"), exp["metadata"]["name"],
                                       exp.get("spec") or {}, exp.get("status") or {})
               for exp in cache.held(RLExperiment.KIND))
    return [t for t in targets if t is not None]


def trainer_pod_ip(cache: ObjectCache, namespace: str, pod: str) -> str | None:
    """A trainer pod's IP: rank 0's is where the poller finds /progress (the pod binds only it)."""
    held = cache.get("Pod", namespace, pod)
    labels = (held or {}).get("metadata", {}).get("labels") or {}
    return ((held or {}).get("status") or {}).get("podIP") if labels.get(LABEL_ROLE) == ROLE_TRAINER else None


@kopf.on.cleanup()
async def stop_polling(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState | None = memo.get("state")
    if state is None:  # the start-up handler did not get that far
        return
    for task in [*state.tasks, *state.retries.values(), *state.labelling.values()]:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await state.queue.stop()
    await state.kube.close()


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else $KUBECONFIG (read at login time, not import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _kube(memo: kopf.Memo) -> Kube:
    return _state(memo).kube


def _observed(memo: kopf.Memo, obj: Manifest, live: bool) -> bool:
    """Put the object into the cache (or take it out); whether it is news (``ObjectCache.observe``:
    the operator's own writes come back as events it already knows and trigger nothing)."""
    cache = _state(memo).cache
    if "metadata" not in obj:
        return True
    if not live:
        if not cache.of_our_group(obj):
            return False
        meta = obj["metadata"]
        cache.forget(obj.get("kind", ""), meta.get("namespace"), meta["name"])
        return True
    return cache.observe(obj)


SYNCS: dict[str, Callable[[Kube, str, str, BuildSettings], Awaitable[Any]]] = {
    RLExperiment.KIND: reconcile.sync_experiment,
    InferencePool.KIND: reconcile.sync_pool,
    TrainerJob.KIND: reconcile.sync_job,
}


@dataclass
class Convergence:
    """Per experiment: whether a full sync is asked for, and the generation its last full sync
    converged (children ensured, status rolled up); changed only through these methods. A roll-up
    alone does when the last full sync converged the current generation and nothing asked for more."""

    _full: set[tuple[str, str, str]] = field(default_factory=set)
    _converged: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def ask_full(self, key: SyncKey) -> None:
        self._full.add(key)

    def take(self, key: SyncKey) -> tuple[bool, int | None]:
        """(full sync asked for — and now taken, the generation last converged)."""
        full = key in self._full
        self._full.discard(key)
        if full:
            self._converged.pop(key, None)
        return full, self._converged.get(key)

    def record(self, key: SyncKey, generation: int | None) -> None:
        """What a sync converged (None: nothing; the next one is full)."""
        if generation is None:
            self._converged.pop(key, None)
            self._full.add(key)
        else:
            self._converged[key] = generation

    def forget(self, key: SyncKey) -> None:
        self._full.discard(key)
        self._converged.pop(key, None)


def request_sync(memo: kopf.Memo, kind: str, namespace: str, name: str, roll_up: bool = False) -> None:
    """Queue ``kind``'s sync of one object (``workqueue``: at most once while it waits, never two at
    once). ``roll_up``: an experiment's status is all that is asked for (its child wrote its own);
    any other request for it asks for the full sync, and wins."""
    key = (kind, namespace, name)
    if kind == RLExperiment.KIND and not roll_up:
        _state(memo).convergence.ask_full(key)
    _state(memo).queue.add(key)


async def _sync(memo: kopf.Memo, key: SyncKey) -> None:
    """``key``'s sync; an experiment's only rolls its children's status up unless a full one was
    asked for or its last full one did not converge this generation (``reconcile.roll_up_experiment``)."""
    kind, namespace, name = key
    build = _state(memo).settings.build
    if kind != RLExperiment.KIND:
        await SYNCS[kind](_kube(memo), namespace, name, build)
        return
    convergence = _state(memo).convergence
    full, converged = convergence.take(key)
    if full:
        generation = await reconcile.sync_experiment(_kube(memo), namespace, name, build)
    else:
        generation = await reconcile.roll_up_experiment(_kube(memo), namespace, name, converged, build)
    convergence.record(key, generation)


def _follow_up(memo: kopf.Memo, synced: SyncKey, written: Key) -> None:
    """Ask for the syncs one write of ``synced``'s sync calls for (``routing.follow_ups``), as it
    answers: a pool or job an experiment's sync just created starts on its pods while that sync goes on."""
    for follow in routing.follow_ups(synced, [written], _state(memo).cache.get):
        request_sync(memo, *follow, roll_up=follow[0] == RLExperiment.KIND)  # a child's status: the roll-up


async def _sync_once(memo: kopf.Memo, key: SyncKey) -> None:
    """One sync; each of its writes asks for the syncs it calls for at once (``_follow_up``). On failure:
    log it, report it on the object when it will not heal by itself or has persisted (``retry.reported``:
    ``Degraded`` condition + Event),
    and schedule a retry with per-object exponential backoff (``retry``). A success clears the count."""
    kind, namespace, name = key
    backoff = _state(memo).backoff
    token = ON_WRITE.set(lambda written: _follow_up(memo, key, written))
    try:
        await _sync(memo, key)
    except Exception as err:
        if kind == RLExperiment.KIND:  # its retry converges in full
            _state(memo).convergence.record(key, None)
        failure = classify(err)
        attempt, delay = backoff.failed(key, failure.retry_after)
        level = logging.INFO if failure.reason == "ApiError409" else logging.WARNING  # a lost race: routine
        log.log(level, "%s %s/%s: sync failed (%s: %s); retry %d in %.0fs", kind, namespace, name, failure.reason,
                failure.message, attempt, delay, exc_info=failure.reason == "InternalError")
        if (report := reported(failure, attempt)) is not None:
            body = await reconcile.report_failure(_kube(memo), kind, namespace, name, report.reason, report.message)
            if body is not None:
                await children.post_event(_kube(memo), body, report.reason, report.message)
        ON_WRITE.reset(token)
        _schedule_retry(memo, key, delay)
    else:
        ON_WRITE.reset(token)
        if backoff.succeeded(key):
            log.info("%s %s/%s: in sync again", kind, namespace, name)


def _schedule_retry(memo: kopf.Memo, key: SyncKey, delay: float) -> None:
    """One pending retry per object: a newer one replaces it."""
    retries = _state(memo).retries

    async def later() -> None:
        await asyncio.sleep(delay)
        if retries.get(key) is asyncio.current_task():
            del retries[key]
        request_sync(memo, *key)

    if (old := retries.get(key)) is not None:
        old.cancel()
    retries[key] = asyncio.create_task(later(), name=RETRY_TASK + "/".join(key))


async def on_object(memo: kopf.Memo, obj: Manifest, live: bool) -> None:
    """Any watched object as delivered (``live`` False: deleted): into the cache; someone else's change
    (not the echo of the operator's own write, whose sync called for what it needs:
    ``routing.follow_ups``) asks for the syncs it calls for (``routing.syncs_for``). A freshly
    scheduled pod of the operator's gets its node's topology labels, beside this (a failure is
    retried by the pod's next event)."""
    if not _observed(memo, obj, live):
        return
    if obj.get("kind") == RLExperiment.KIND and not live:
        _state(memo).convergence.forget((RLExperiment.KIND, obj["metadata"].get("namespace"), obj["metadata"]["name"]))
    if obj.get("kind") == "Pod" and live and missing_topology(obj) is not None:
        _label_topology(memo, obj)
    for key in routing.syncs_for(obj, live):
        request_sync(memo, *key)


def _label_topology(memo: kopf.Memo, pod: Manifest) -> None:
    """``reconcile.label_pod_topology`` as a task of its own (one per pod at a time): the informer
    goes on with the next event meanwhile."""
    labelling, key = _state(memo).labelling, object_key(pod)
    if key in labelling:
        return

    async def label() -> None:
        try:
            await reconcile.label_pod_topology(_kube(memo), pod)
        except Exception as err:
            log.warning("pod %s: topology labels not written (%s)", pod["metadata"]["name"], classify(err).message)
        finally:
            labelling.pop(key, None)

    labelling[key] = asyncio.get_running_loop().create_task(label(), name=LABEL_TASK + "/".join(map(str, key)))
