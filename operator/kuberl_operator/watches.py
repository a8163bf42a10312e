"""What the operator watches: each kind, where its API lives, and which of its objects it cares about.

Each kind is watched by an informer of the operator's (``informer``). The custom resources whole;
the children's kinds only for the labels the operator puts on what it creates (``Watched.labels``,
sent as the API server's label selector, ``Watched.selector``), so the API server never sends
another tenant's pods or ConfigMaps unless they wear those labels (and then the cache drops them:
``cache.ObjectCache.controlled``). What is held is filled before the first sync, owners first
(``WATCHED``'s order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kuberl.api import API_GROUP, API_VERSION, InferencePool, RLExperiment, TrainerJob
from kuberl.api.contract import LABEL_JOB, LABEL_ROLE, MANAGED_BY

from .builders.kubeflow import PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, TRAINER_GROUP, TRAINER_VERSION

LabelFilter = Mapping[str, str | None]  # a label's value, or None: the key with any value


def label_selector(labels: LabelFilter) -> str:
    """``labels`` as the API server's label selector: ``key=value`` for a value, ``key`` for None,
    joined by commas (all must hold)."""
    return ",".join(key if value is None else f"{key}={value}" for key, value in labels.items())


@dataclass(frozen=True)
class Watched:
    group: str
    version: str
    plural: str
    kind: str
    labels: LabelFilter | None = None  # None: every object of the kind

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def selector(self) -> str | None:
        return label_selector(self.labels) if self.labels is not None else None


EXPERIMENTS = Watched(API_GROUP, API_VERSION, "rlexperiments", RLExperiment.KIND)
POOLS = Watched(API_GROUP, API_VERSION, "inferencepools", InferencePool.KIND)
JOBS = Watched(API_GROUP, API_VERSION, "trainerjobs", TrainerJob.KIND)
PODS = Watched("", "v1", "pods", "Pod", {LABEL_ROLE: None})
PYTORCHJOBS = Watched(PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, "pytorchjobs", "PyTorchJob", {LABEL_JOB: None})
TRAINJOBS = Watched(TRAINER_GROUP, TRAINER_VERSION, "trainjobs", "TrainJob", {LABEL_JOB: None})
OWNED = (  # the other children: by the labels every object the operator creates carries
    Watched("", "v1", "configmaps", "ConfigMap", MANAGED_BY),
    Watched("", "v1", "services", "Service", MANAGED_BY),
    Watched("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", MANAGED_BY),
    Watched("apps", "v1", "deployments", "Deployment", MANAGED_BY),
)
WATCHED = (EXPERIMENTS, POOLS, JOBS, PYTORCHJOBS, TRAINJOBS, PODS, *OWNED)  # owners first: listed in this order
# Read from the cache, not the API server: every kind watched. Secrets (not watchable without list
# on all of them), Nodes and PodGroups are read from the API server.
CACHED_KINDS = tuple(w.kind for w in WATCHED)
CACHED_GROUPS = {w.kind: w.group for w in WATCHED}  # one API group per cached kind (the cache key names the kind)
ROOT_KINDS = (EXPERIMENTS.kind, POOLS.kind, JOBS.kind)  # held whoever owns them; the rest only when controlled
