"""Gather a failed experiment's post-mortem bundle (``builders.postmortem``) and keep it.

When an experiment turns Failed, the operator reads, from the API server (not its cache: this happens
once, and what the cache holds may lag), the experiment's pods and Events and each container's last
log lines (current and, after a restart, previous), builds the bundle and writes it to the ConfigMap
``<experiment>-postmortem`` — the pods may be gone within minutes (a TrainJob's TTL, a node drained),
the ConfigMap stays until the experiment is deleted. ``status.postmortem`` names it, with a
``kubectl`` line that unpacks it. What cannot be read (a log of a pod already deleted) is left out and
said in the log; a bundle that cannot be written at all is said in ``status.postmortem.error`` — a
post-mortem never holds up the status that says Failed.

The operator holds no storage credentials (the pods read them by reference), so the bundle stays in
the cluster; copying it to the checkpoint store is the reader's step, with their own credentials
(``kuberl postmortem NAME --to checkpoint``: ``kuberl_cli.postmortem``).
"""

from __future__ import annotations

import logging
from typing import Any

from kuberl.api.contract import (
    LABEL_EXPERIMENT,
    POSTMORTEM_ARCHIVE_KEY,
    inference_pool_name,
    postmortem_config_map_name,
    trainer_job_name,
)

from .builders.postmortem import (
    LOG_LIMIT_BYTES,
    LOG_TAIL_LINES,
    bounded_archive,
    config_map,
    involved_names,
)
from .children import now, post_event
from .kube import ApiError, Kube

log = logging.getLogger("kuberl.operator")
Manifest = dict[str, Any]


async def container_logs(kube: Kube, pod: Manifest) -> dict[str, str]:
    """``<pod>/<container>[.previous]`` → its last lines, for each container that has run (a previous
    one after a restart); a log the API server cannot give (the pod gone, never started) is left out."""
    meta, logs = pod["metadata"], {}
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        runs = [False] + ([True] if status.get("restartCount") else [])
        for previous in runs:
            key = f"{meta['name']}/{status['name']}{'.previous' if previous else ''}"
            try:
                logs[key] = await kube.pod_log(meta.get("namespace"), meta["name"], status["name"], LOG_TAIL_LINES,
                                               LOG_LIMIT_BYTES, previous)
            except ApiError as err:
                log.info("post-mortem: no log for %s (%s)", key, err)
    return logs


async def gather(kube: Kube, experiment: Manifest, reason: str, at: str) -> bytes:
    """The bundle of ``experiment`` as it is at ``at`` (``reason``: why it was taken, e.g. its phase)."""
    meta = experiment["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    pods = await kube.read_list("v1", "Pod", namespace, {LABEL_EXPERIMENT: name})
    names = involved_names(experiment, pods, (inference_pool_name(name), trainer_job_name(name)))
    events = [e for e in await kube.read_list("v1", "Event", namespace, {})
              if (e.get("involvedObject") or {}).get("name") in names]
    logs: dict[str, str] = {}
    for pod in pods:
        logs |= await container_logs(kube, pod)
    return bounded_archive(experiment, events, pods, logs, reason, at)


async def keep(kube: Kube, experiment: Manifest, data: bytes) -> str:
    """Write ``data`` to the experiment's post-mortem ConfigMap (created, or replaced if an earlier
    failure left one); returns its name."""
    meta = experiment["metadata"]
    name = postmortem_config_map_name(meta["name"])
    body = config_map(experiment, name, data, {LABEL_EXPERIMENT: meta["name"]})
    try:
        await kube.create(body)
    except ApiError as err:
        if err.status != 409:
            raise
        await kube.patch("v1", "ConfigMap", meta.get("namespace"), name, {"binaryData": body["binaryData"]})
    return name


async def record(kube: Kube, experiment: Manifest, reason: str) -> Manifest:
    """Gather and keep the bundle; ``status.postmortem`` (the ConfigMap, when, its size, how to read
    it — or the error that stopped it)."""
    meta = experiment["metadata"]
    at = now()
    try:
        data = await gather(kube, experiment, reason, at)  # one time: the archive's index, the status, the key
        name = await keep(kube, experiment, data)
    except Exception as err:  # the status that says Failed goes out regardless
        log.warning("RLExperiment %s/%s: post-mortem not kept (%s)", meta.get("namespace"), meta["name"], err)
        return {"time": at, "error": f"{type(err).__name__}: {err}"[:512]}
    read = (f"kubectl get configmap {name} -n {meta.get('namespace')} -o "
            f"jsonpath='{{.binaryData.{POSTMORTEM_ARCHIVE_KEY.replace('.', chr(92) + '.')}}}' | base64 -d | tar -xz")
    log.info("RLExperiment %s/%s: post-mortem kept in ConfigMap %s (%d bytes)", meta.get("namespace"),
             meta["name"], name, len(data))
    await post_event(kube, experiment, "PostMortemKept", f"{reason}: conditions, Events, pod states and last log "
                     f"lines kept in ConfigMap {name} ({len(data)} bytes); read it: {read}", "Normal")
    return {"configMap": name, "time": at, "bytes": len(data), "reason": reason, "read": read}
