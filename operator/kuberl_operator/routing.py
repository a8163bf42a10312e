"""Which object's sync an event or a write calls for: pure functions of the objects involved.

An RLExperiment owns its InferencePool and TrainerJob (``parent_experiment``); a pool or job owns its
pods (``pod_owner``); someone else's change of a watched object calls for its owner's sync
(``syncs_for``); a sync's own writes call for the syncs they need (``follow_ups``), since their
watch echoes trigger nothing (``cache.ObjectCache.observe``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuberl.api import API_GROUP, InferencePool, RLExperiment, TrainerJob
from kuberl.api.contract import LABEL_JOB, LABEL_POOL

from .cache import Key

Manifest = dict[str, Any]


def owner_name(obj: Manifest, kind: str) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == kind and ref.get("apiVersion", "").startswith(f"{API_GROUP}/"):
            return ref.get("name")
    return None


def parent_experiment(child: Manifest) -> str | None:
    """The RLExperiment a pool or job belongs to: its ``spec.experiment``, when that experiment is
    also its controller (a standalone object naming one is refused by ``claim_problem``)."""
    experiment = (child.get("spec") or {}).get("experiment")
    return experiment if experiment and owner_name(child, RLExperiment.KIND) == experiment else None


SYNCED_KINDS = (RLExperiment.KIND, InferencePool.KIND, TrainerJob.KIND)


def syncs_for(obj: Manifest, live: bool) -> list[Key]:
    """The syncs a change of ``obj`` that the operator did not make calls for (``live``: it still
    exists; else it was deleted). An experiment: its own. A pool or job: its own and its experiment's
    (whose status rolls up the child's, and which puts back a spec someone else changed). A pod: its
    pool's or job's. A PyTorchJob or TrainJob: its TrainerJob's (a deletion may end a runtime switch). Any other
    child: its controller's, which puts it back."""
    kind, meta = obj.get("kind"), obj["metadata"]
    namespace = meta.get("namespace")
    own = [(kind, namespace, meta["name"])] if live and kind in SYNCED_KINDS else []
    if kind == RLExperiment.KIND:
        return own
    if kind in (InferencePool.KIND, TrainerJob.KIND):
        experiment = parent_experiment(obj)
        return own + ([(RLExperiment.KIND, namespace, experiment)] if experiment is not None else [])
    if kind == "Pod":
        owner = pod_owner(obj)
        return [(owner[0], namespace, owner[1])] if owner is not None else []
    if kind in ("PyTorchJob", "TrainJob"):
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        return [(TrainerJob.KIND, namespace, job)] if job else []
    return [(ref["kind"], namespace, ref["name"]) for ref in meta.get("ownerReferences") or []
            if ref.get("controller") and ref.get("kind") in SYNCED_KINDS
            and ref.get("apiVersion", "").startswith(API_GROUP)]


def follow_ups(synced: Key, written: list[Key],
               cached: Callable[[str, str | None, str], Manifest | None]) -> list[Key]:
    """The syncs that ``synced``'s sync called for by its own writes (whose watch echoes trigger
    nothing): every pool or job it created or changed (an experiment's children: they build their
    pods), and — when it wrote its own pool's or job's status — the experiment that rolls it up."""
    wanted = [k for k in written if k[0] in (InferencePool.KIND, TrainerJob.KIND) and k != synced]
    if synced[0] in (InferencePool.KIND, TrainerJob.KIND) and synced in written:
        body = cached(*synced)
        experiment = parent_experiment(body) if body is not None else None
        if experiment is not None:
            wanted.append((RLExperiment.KIND, synced[1], experiment))
    return list(dict.fromkeys(wanted))


def pod_owner(pod: Manifest) -> tuple[str, str] | None:
    """(kind, name) of the pool or job a pod belongs to: the one to re-sync when it changes (a
    PyTorchJob's pods carry the job's label too: their going ends a runtime switch)."""
    labels = pod["metadata"].get("labels") or {}
    if LABEL_POOL in labels:
        return InferencePool.KIND, labels[LABEL_POOL]
    job = owner_name(pod, TrainerJob.KIND) or labels.get(LABEL_JOB)
    return (TrainerJob.KIND, job) if job is not None else None
