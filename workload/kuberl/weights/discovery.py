"""Where every rank runs, from pod labels (docs/architecture.md, "The contract"): the planner's topology input.

Each pod reads its own labels from the downward-API file (``/etc/kuberl/podinfo/labels``, one
``key="value"`` per line, values Go-quoted); the operator puts ``kuberl.io/node``, ``/fabric`` and
``/zone`` there once the pod is scheduled. Until that label arrives (the kubelet refreshes the file
within about a minute) the ``NODE_NAME`` env (downward API ``spec.nodeName``) names the node. Peers
are not read from the API (the workload has no API access): trainer ranks exchange their
topology over the trainer's process group and each inference server reports its own on
``GET /topology``. Local mode writes the same label file for every process it starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from ..api.contract import LABEL_FABRIC, LABEL_NODE, LABEL_ZONE
from .plan import RankTopology


def parse_labels(text: str) -> dict[str, str]:
    """The downward-API labels file: ``key="value"`` per line (value escaped like a Go string)."""
    labels = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        labels[key.strip()] = json.loads(value) if value.startswith('"') else value
    return labels


def format_labels(labels: Mapping[str, str]) -> str:
    """The inverse of :func:`parse_labels` (what local mode writes)."""
    return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(labels.items()))


def topology_from_labels(labels: Mapping[str, str], fallback_node: str = "") -> RankTopology:
    node = labels.get(LABEL_NODE) or fallback_node
    if not node:
        raise ValueError(f"pod labels have no {LABEL_NODE} and NODE_NAME is unset: cannot place this rank")
    return RankTopology(node=node, fabric=labels.get(LABEL_FABRIC, ""), zone=labels.get(LABEL_ZONE, ""))


def own_topology(labels_file: Path, node_name: str = "") -> RankTopology:
    """This process's place: its pod labels (``labels_file``, the downward API's), else ``node_name``
    (``NODE_NAME``), else the host name (bare processes)."""
    labels = parse_labels(labels_file.read_text()) if labels_file.is_file() else {}
    return topology_from_labels(labels, node_name or os.uname().nodename)


def to_json(t: RankTopology) -> dict[str, str]:
    return {"node": t.node, "fabric": t.fabric, "zone": t.zone}


def from_json(d: Mapping[str, str]) -> RankTopology:
    return RankTopology(node=d["node"], fabric=d.get("fabric", ""), zone=d.get("zone", ""))
