"""Training progress into ``RLExperiment.status.progress`` (the STEP / VERSION / REWARD / STALENESS
columns of ``kubectl get rlx``).

Trainer rank 0 serves ``GET /progress`` (``kuberl.trainer.progress``); the operator polls it for
every experiment in phase Running and patches the status when it changed, so the workload pods
need no access to the Kubernetes API. The URL is ``http://{host}:{port}/progress`` with rank 0's
stable DNS name as host (``names.trainer_rank0_host``: under the TrainerJob's headless Service, or
Kubeflow's per-pod Service for the kubeflow runtime); ``KUBERL_PROGRESS_URL`` overrides it with a
template using the same fields (an operator running outside the cluster, or tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.request
from typing import Any

from kubernetes.client import ApiException

from kuberl.api import API_GROUP, API_VERSION, RLExperiment
from kuberl.api.contract import PROGRESS_PORT, trainer_job_name, trainer_rank0_host, trainer_rank0_pod

from .kube import Kube

log = logging.getLogger("kuberl.operator.progress")
Manifest = dict[str, Any]
DEFAULT_URL = "http://{host}:{port}/progress"


def is_kubeflow(exp: Manifest) -> bool:
    return ((exp.get("spec") or {}).get("trainer") or {}).get("runtime") == "kubeflow"


def progress_url(experiment: str, namespace: str, template: str | None = None, kubeflow: bool = False) -> str:
    """Trainer rank 0's /progress; ``template`` (``$KUBERL_PROGRESS_URL``) may use {host}, {pod},
    {job}, {namespace}, {name} and {port}."""
    job = trainer_job_name(experiment)
    return (template or DEFAULT_URL).format(host=trainer_rank0_host(job, namespace, kubeflow),
                                            pod=trainer_rank0_pod(job, kubeflow), job=job, namespace=namespace,
                                            name=experiment, port=PROGRESS_PORT)


MAX_REPLY_BYTES = 64 * 1024


def progress_status(payload: Any) -> Manifest:
    """The trainer's /progress JSON → ``status.progress`` (camelCase). Only well-typed values are
    kept (a number where a number belongs, a short string for the checkpoint URI): whatever a pod
    answers, the status never carries anything else."""
    if not isinstance(payload, dict):
        return {}

    def number(key: str, digits: int | None = None) -> float | int | None:
        value = payload.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value or abs(value) > 1e15:
            return None
        return round(float(value), digits) if digits is not None else int(value)

    checkpoint = payload.get("last_checkpoint")
    fields = {
        "step": number("step"),
        "version": number("version"),
        "reward": number("reward", 4),
        "rewardFirst10": number("reward_first10", 4),
        "rewardLast10": number("reward_last10", 4),
        "maxStaleness": number("max_staleness"),
        "behavLogpGap": number("behav_logp_gap", 4),
        "lastCheckpoint": checkpoint if isinstance(checkpoint, str) and len(checkpoint) <= 1024 else None,
    }
    return {k: v for k, v in fields.items() if v is not None}


def fetch(url: str, timeout: float = 2.0) -> Manifest | None:
    """GET the progress JSON; None (with the reason logged) when the trainer is not reachable yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(MAX_REPLY_BYTES + 1)
        if len(body) > MAX_REPLY_BYTES:
            raise ValueError(f"reply larger than {MAX_REPLY_BYTES} bytes")
        return json.loads(body)
    except (OSError, ValueError, RecursionError) as err:
        log.debug("progress from %s unavailable: %s", url, err)
        return None


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


def final_progress(kube: Kube, namespace: str, experiment: str, kubeflow: bool = False) -> Manifest | None:
    """``status.progress`` from trainer rank 0's termination message (it has exited: nothing to poll)."""
    pod = kube.get("v1", "Pod", namespace, trainer_rank0_pod(trainer_job_name(experiment), kubeflow))
    payload = termination_progress(pod)
    return progress_status(payload) if payload else None


def poll_once(kube: Kube, template: str | None = None) -> int:
    """Update every running experiment whose progress changed; returns how many were patched."""
    patched = 0
    for exp in kube.list(f"{API_GROUP}/{API_VERSION}", RLExperiment.KIND, None, {}):
        status, meta = exp.get("status") or {}, exp["metadata"]
        if status.get("phase") != "Running":
            continue
        payload = fetch(progress_url(meta["name"], meta["namespace"], template, is_kubeflow(exp)))
        if payload is None:
            continue
        progress = progress_status(payload)
        if progress and progress != status.get("progress"):
            try:
                kube.patch(exp["apiVersion"], exp["kind"], meta["namespace"], meta["name"],
                           {"status": {"progress": progress}}, "status")
            except ApiException as err:  # one experiment's failure never costs the others their update
                if err.status != 404:  # 404: deleted since the list, nothing to report on
                    log.warning("progress of %s/%s not written (%s); retried next round", meta["namespace"],
                                meta["name"], err.status)
                continue
            patched += 1
    return patched


async def poll_forever(kube: Kube, interval: float) -> None:
    """``poll_once`` every ``interval`` seconds until cancelled; a failed round is logged and retried."""
    template = os.environ.get("KUBERL_PROGRESS_URL")
    while True:
        try:
            await asyncio.to_thread(poll_once, kube, template)
        except Exception:
            log.exception("progress polling failed; retrying in %.0fs", interval)
        await asyncio.sleep(interval)
