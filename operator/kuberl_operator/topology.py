"""Copy a node's topology onto a scheduled pod as ``kuberl.io/*`` labels (docs/architecture.md, "The contract").

The weight-exchange planner ranks links by these labels: same node > same fabric > same zone.
"""

from __future__ import annotations

import re
from typing import Any

from kuberl.api.contract import LABEL_FABRIC, LABEL_NODE, LABEL_ZONE

ZONE_LABELS = ("topology.kubernetes.io/zone",)
# First present wins: an admin's explicit label, NVLink clique (GB200 NVL72), an Ascend
# super-pod id, then the rack.
FABRIC_LABELS = (
    LABEL_FABRIC,
    "nvidia.com/gpu.clique",
    "huawei.com/super-pod-id",
    "topology.kubernetes.io/rack",
)
_INVALID = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """A valid label value: ≤ 63 chars of [A-Za-z0-9_.-], alphanumeric at both ends."""
    return _INVALID.sub("-", text)[:63].strip("-_.")


def topology_labels(node_name: str, node_labels: dict[str, str]) -> dict[str, str]:
    """The ``kuberl.io`` topology labels for a pod on ``node_name``."""
    out = {LABEL_NODE: label_value(node_name)}
    for key in ZONE_LABELS:
        if node_labels.get(key):
            out[LABEL_ZONE] = label_value(node_labels[key])
            break
    for key in FABRIC_LABELS:
        if node_labels.get(key):
            out[LABEL_FABRIC] = label_value(node_labels[key])
            break
    return out


def missing_topology(pod: dict[str, Any]) -> str | None:
    """The node name when the pod is scheduled but not yet labelled, else None."""
    node = (pod.get("spec") or {}).get("nodeName")
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return node if node and LABEL_NODE not in labels else None
