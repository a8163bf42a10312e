"""kopf handlers: thin, level-triggered, all logic in ``reconcile``.

Every event on an RLExperiment, InferencePool, TrainerJob or one of our pods re-runs the owning
object's idempotent sync. The periodic safety net is kopf's watch itself: every
``settings.watching.server_timeout`` seconds it reconnects, re-lists every object and fires these
handlers again. No timers and no on.delete handlers, so kopf adds no finalizers: deleting an
experiment never waits for the operator, owner references do the cleanup. A background task
polls each running experiment's trainer for progress (``progress.py``). Handlers are
registered with the fully-qualified group (``kuberl.io``), because ``InferencePool`` is also a kind
of the Gateway API Inference Extension and kopf silently ignores ambiguous selectors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import kopf
from kubernetes import config as kube_config
from kubernetes.client import ApiClient

from kuberl.api import API_GROUP, API_VERSION
from kuberl.api.contract import LABEL_JOB, LABEL_ROLE, PREFIX

from . import progress, reconcile
from .kube import Kube

RESYNC_SECONDS = int(os.environ.get("KUBERL_RESYNC_SECONDS", "300"))
PROGRESS_TASK = "kuberl-progress-polling"
EXPERIMENTS = (API_GROUP, API_VERSION, "rlexperiments")
POOLS = (API_GROUP, API_VERSION, "inferencepools")
JOBS = (API_GROUP, API_VERSION, "trainerjobs")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = RESYNC_SECONDS
    settings.networking.error_backoffs = [1, 2, 5, 10]
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        # The package reads $KUBECONFIG at import time; read it now.
        kube_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    memo["kube"] = Kube(ApiClient())
    interval = float(os.environ.get("KUBERL_PROGRESS_SECONDS", "10"))
    memo["progress"] = asyncio.get_running_loop().create_task(progress.poll_forever(memo["kube"], interval),
                                                             name=PROGRESS_TASK)
    logger.info("KubeRL operator ready (full resync every %ds, progress every %.0fs)", RESYNC_SECONDS, interval)


@kopf.on.cleanup()
async def stop_polling(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("progress")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else $KUBECONFIG (read at login time, not import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _kube(memo: kopf.Memo) -> Kube:
    return memo["kube"]


def _live(event: dict[str, Any]) -> bool:
    return event.get("type") != "DELETED"


@kopf.on.event(*EXPERIMENTS)
def experiment_event(event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    if _live(event):
        reconcile.sync_experiment(_kube(memo), namespace, name)


@kopf.on.event(*POOLS)
@kopf.on.event(*JOBS)
def child_event(event: dict[str, Any], body: kopf.Body, name: str, namespace: str, resource: kopf.Resource,
                memo: kopf.Memo, **_: Any) -> None:
    kube = _kube(memo)
    if _live(event):
        sync = reconcile.sync_pool if resource.plural == "inferencepools" else reconcile.sync_job
        sync(kube, namespace, name)
    experiment = (body.get("spec") or {}).get("experiment")
    if experiment and reconcile.owner_name(dict(body), "RLExperiment") == experiment:
        reconcile.sync_experiment(kube, namespace, experiment)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={LABEL_JOB: kopf.PRESENT})
def pytorchjob_event(event: dict[str, Any], labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """trainer.runtime kubeflow: the Kubeflow training operator's status → the TrainerJob's (whose
    own event then updates the experiment). Without the PyTorchJob CRD or RBAC for it (chart value
    integrations.kubeflowTraining), kopf warns once and does not watch."""
    if _live(event):
        reconcile.sync_job(_kube(memo), namespace, labels[LABEL_JOB])


@kopf.on.event("", "v1", "pods", labels={LABEL_ROLE: kopf.PRESENT})
def pod_event(event: dict[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    kube = _kube(memo)
    pod = dict(body)
    if _live(event):
        reconcile.label_pod_topology(kube, pod)
    reconcile.sync_pod_owner(kube, pod)
