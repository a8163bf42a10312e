"""A failed experiment's post-mortem bundle: what a person needs to see why, after the pods are gone.

One gzipped tar (pure: built from objects the operator read, no I/O here):

- ``experiment.yaml`` — the RLExperiment: metadata (no managedFields), spec (secrets appear in it only
  by reference), status — its conditions, ``status.progress`` with the ledger's position and the last
  weight push;
- ``events.yaml`` — the Events about the experiment, its pool and job, and their pods, oldest first;
- ``pods.yaml`` — each pod's phase, node, conditions and containers' states: restarts, exit codes,
  termination messages (the trainer's last progress) — not its spec, whose env a team may have
  written by value;
- ``logs/<pod>/<container>.log`` (and ``.previous.log``, the container before its last restart) — the
  last :data:`LOG_TAIL_LINES` lines, at most :data:`LOG_LIMIT_BYTES` each, with anything that looks like
  a credential blanked (:func:`redact`: defence in depth; KubeRL's processes log none);
- ``index.yaml`` — when, why, and which logs were cut.

The whole archive stays under :data:`MAX_ARCHIVE_BYTES` (a ConfigMap holds at most 1 MiB): logs are
cut to half their length until it fits (:func:`bounded_archive`). The operator keeps it in the
ConfigMap ``<experiment>-postmortem`` (``kuberl.api.contract.postmortem_config_map_name``), owned by
the experiment, and names it in ``status.postmortem``.
"""

from __future__ import annotations

import base64
import gzip
import io
import re
import tarfile
from collections.abc import Mapping
from typing import Any

import yaml

from kuberl.api.contract import POSTMORTEM_ARCHIVE_KEY

from .common import child_metadata

Manifest = dict[str, Any]
LOG_TAIL_LINES = 200
LOG_LIMIT_BYTES = 64 * 1024
MAX_ARCHIVE_BYTES = 512 * 1024

_CREDENTIAL = re.compile(
    r"(?i)(\b(?:authorization|x-api-key)\s*[:=]\s*(?:bearer\s+|basic\s+)?|"
    r"\b[\w.-]*(?:token|secret|password|passwd|api[_-]?key|access[_-]?key|credential)[\w.-]*\s*[=:]\s*)"
    r"(['\"]?)[^\s'\",;}]+")


def redact(text: str) -> str:
    """``text`` with the value of every ``NAME=value`` / ``NAME: value`` whose name says token,
    secret, password, API or access key, or credential, and of Authorization headers, replaced by
    ``<redacted>``."""
    return _CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}<redacted>", text)


def _without_managed_fields(obj: Manifest) -> Manifest:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def pod_summary(pod: Manifest) -> Manifest:
    """What a pod says about how it went, without its spec."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    return {"name": meta.get("name"), "labels": meta.get("labels") or {}, "node": (pod.get("spec") or {}).get(
        "nodeName"), "phase": status.get("phase"), "reason": status.get("reason"), "message": status.get("message"),
        "conditions": status.get("conditions") or [],
        "containers": [{k: c.get(k) for k in ("name", "ready", "restartCount", "state", "lastState")}
                       for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])]}


def involved_names(experiment: Manifest, pods: list[Manifest], children: tuple[str, ...]) -> set[str]:
    """The names whose Events belong in the bundle: the experiment, its children, its pods."""
    return {experiment["metadata"]["name"], *children, *(p["metadata"]["name"] for p in pods)}


def _event_time(event: Manifest) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp") or "")


def _tail(text: str, limit: int) -> tuple[str, bool]:
    """The last ``limit`` bytes of ``text`` from a line start; whether anything was cut."""
    data = text.encode()
    if len(data) <= limit:
        return text, False
    kept = data[-limit:]
    newline = kept.find(b"\n")
    return kept[newline + 1:].decode(errors="replace") if newline >= 0 else kept.decode(errors="replace"), True


def archive(experiment: Manifest, events: list[Manifest], pods: list[Manifest], logs: Mapping[str, str],
            reason: str, at: str, log_limit: int = LOG_LIMIT_BYTES) -> bytes:
    """The bundle (module docstring); ``logs``: ``<pod>/<container>[.previous]`` → text; each log cut to
    its last ``log_limit`` bytes."""
    files: dict[str, str] = {}
    cut = []
    for key, text in sorted(logs.items()):
        kept, was_cut = _tail(redact(text), log_limit)
        files[f"logs/{key}.log"] = kept
        if was_cut:
            cut.append(key)
    files["experiment.yaml"] = yaml.safe_dump(_without_managed_fields(experiment), sort_keys=False)
    files["events.yaml"] = yaml.safe_dump([{k: e.get(k) for k in ("type", "reason", "message", "count",
                                                                  "firstTimestamp", "lastTimestamp")}
                                           | {"object": (e.get("involvedObject") or {}).get("name")}
                                           for e in sorted(events, key=_event_time)], sort_keys=False)
    files["pods.yaml"] = yaml.safe_dump([pod_summary(p) for p in pods], sort_keys=False)
    files["index.yaml"] = yaml.safe_dump({"experiment": experiment["metadata"]["name"], "reason": reason,
                                          "time": at, "logs_cut_to_bytes": log_limit, "logs_cut": cut},
                                         sort_keys=False)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"postmortem/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def bounded_archive(experiment: Manifest, events: list[Manifest], pods: list[Manifest], logs: Mapping[str, str],
                    reason: str, at: str, limit: int = MAX_ARCHIVE_BYTES) -> bytes:
    """:func:`archive` under ``limit`` bytes: each log cut to half as much until it fits (to nothing at
    worst: the objects and Events alone are far smaller than a ConfigMap)."""
    log_limit = LOG_LIMIT_BYTES
    while True:
        data = archive(experiment, events, pods, logs, reason, at, log_limit)
        if len(data) <= limit or log_limit == 0:
            return data
        log_limit //= 2


def config_map(experiment: Manifest, name: str, data: bytes, labels: dict[str, str]) -> Manifest:
    """The ConfigMap that keeps the bundle (``binaryData``), owned by the experiment."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": child_metadata(experiment, name, labels),
            "binaryData": {POSTMORTEM_ARCHIVE_KEY: base64.b64encode(data).decode()}}
