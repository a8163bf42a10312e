"""Which running pods to replace after their template changed (a spec edit, a new run config).

Every pod the builders make carries ``kuberl.io/template-hash``; a live pod whose hash differs from
the one its name would get now runs a stale template. A trainer gang is replaced whole (its ranks
resume from the last checkpoint, as after a gang restart); an inference pool rolls one replica at
a time, so the rest keeps serving: a stale replica that is not ready goes at once, a ready one only
when every pod is present, none is terminating and every up-to-date pod is ready. A pod without
the annotation (made by an older operator) is left alone.
"""

from __future__ import annotations

from typing import Any

from kuberl.api.contract import ANNOTATION_TEMPLATE_HASH, LABEL_REPLICA

Manifest = dict[str, Any]


def _hash(pod: Manifest) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)


def _ready(pod: Manifest) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def stale_pods(desired: dict[str, str], pods: list[Manifest]) -> list[Manifest]:
    """Live pods whose template hash differs from ``desired[name]`` (both known)."""
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and _hash(p) is not None
            and p["metadata"]["name"] in desired and desired[p["metadata"]["name"]] != _hash(p)]


def pods_to_replace(desired: dict[str, str], pods: list[Manifest], gang: bool) -> list[str]:
    """Names of the pods to delete now (the next sync recreates them from the new template)."""
    stale = stale_pods(desired, pods)
    if not stale:
        return []
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if gang:
        return sorted(p["metadata"]["name"] for p in live)
    doomed = {p["metadata"]["name"] for p in stale if not _ready(p)}
    stale_names = {p["metadata"]["name"] for p in stale}
    settled = (len(live) == len(pods) and {p["metadata"]["name"] for p in live} >= desired.keys()
               and all(_ready(p) for p in live if p["metadata"]["name"] not in stale_names))
    if settled and not doomed:
        replica = min((p["metadata"].get("labels") or {}).get(LABEL_REPLICA, "") for p in stale)
        doomed = {p["metadata"]["name"] for p in stale if (p["metadata"].get("labels") or {}).get(LABEL_REPLICA, "")
                  == replica}
    return sorted(doomed)
