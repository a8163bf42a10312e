"""An Event about one object (``kubectl describe`` shows it under Events), as kopf posts them."""

from __future__ import annotations

from typing import Any

Manifest = dict[str, Any]
REPORTER = "kuberl-operator"
MAX_MESSAGE = 1024  # characters; the API server refuses longer event messages


def object_event(involved: Manifest, reason: str, message: str, at: str, event_type: str = "Warning") -> Manifest:
    """A core/v1 Event (``generateName``: one per call; ``event_type`` Warning or Normal) in
    ``involved``'s namespace, naming it by uid; a message over ``MAX_MESSAGE`` characters keeps its
    start and end around ``...``."""
    meta = involved["metadata"]
    if len(message) > MAX_MESSAGE:
        half = (MAX_MESSAGE - 3) // 2
        message = f"{message[:half]}...{message[-half:]}"
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"namespace": meta.get("namespace") or "default", "generateName": f"{meta['name']}."},
        "type": event_type, "reason": reason, "message": message,
        "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"], "name": meta["name"],
                           "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "source": {"component": REPORTER}, "reportingComponent": REPORTER,
        "firstTimestamp": at, "lastTimestamp": at, "count": 1,
    }
