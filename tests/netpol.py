"""An independent reading of Kubernetes NetworkPolicy ingress semantics, to ask of rendered policies
"may this pod open that port on that pod?" (the emulator stores policies but enforces nothing).

A pod selected by some Ingress policy of its namespace is isolated: a connection is allowed when a
rule of one of those policies admits it — a rule without ``from`` admits every source, one without
``ports`` every port; a peer with ``podSelector`` only matches pods of the policy's namespace, with
``namespaceSelector`` only pods of matching namespaces, with both pods matching both. A pod no
policy selects accepts everything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PodRef:
    labels: dict[str, str]
    namespace: str = "team-a"
    namespace_labels: dict[str, str] = field(default_factory=dict)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector: every matchLabels pair and every matchExpressions requirement holds."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict[str, Any], policy_namespace: str, source: PodRef) -> bool:
    namespace_ok = (selects(peer["namespaceSelector"], {**source.namespace_labels,
                                                        "kubernetes.io/metadata.name": source.namespace})
                    if "namespaceSelector" in peer else source.namespace == policy_namespace)
    pod_ok = selects(peer["podSelector"], source.labels) if "podSelector" in peer else True
    return namespace_ok and pod_ok


def _rule_admits(rule: dict[str, Any], policy_namespace: str, source: PodRef, port: int) -> bool:
    ports = rule.get("ports")
    if ports and not any(p.get("port") in (None, port) and p.get("protocol", "TCP") == "TCP" for p in ports):
        return False
    peers = rule.get("from")
    return not peers or any(_peer_admits(peer, policy_namespace, source) for peer in peers)


def allowed(policies: list[dict[str, Any]], source: PodRef, target: PodRef, port: int) -> bool:
    """May ``source`` open TCP ``port`` on ``target`` under ``policies``?"""
    selecting = [p for p in policies if p["metadata"].get("namespace", "team-a") == target.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return True
    return any(_rule_admits(rule, p["metadata"].get("namespace", "team-a"), source, port)
               for p in selecting for rule in p["spec"].get("ingress") or [])
