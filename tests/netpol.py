"""An independent reading of Kubernetes NetworkPolicy semantics, to ask of rendered policies "may
this pod open that port on that pod (or address)?" (the emulator stores policies but enforces nothing).

A pod selected by some Ingress policy of its namespace is isolated: a connection is allowed when a
rule of one of those policies admits it — a rule without ``from`` admits every source, one without
``ports`` every port; a peer with ``podSelector`` only matches pods of the policy's namespace, with
``namespaceSelector`` only pods of matching namespaces, with both pods matching both. A pod no
policy selects accepts everything."""

from __future__ import annotations

import ipaddress
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


def _ip_peer_admits(peer: dict[str, Any], address: str) -> bool:
    block = peer.get("ipBlock")
    if block is None:
        return False
    ip = ipaddress.ip_address(address)
    net = ipaddress.ip_network(block["cidr"])
    if ip.version != net.version or ip not in net:
        return False
    return not any(ip in ipaddress.ip_network(e) for e in block.get("except") or [] if
                   ipaddress.ip_network(e).version == ip.version)


def egress_allowed(policies: list[dict[str, Any]], source: PodRef, destination: PodRef | str, port: int) -> bool:
    """May ``source`` open TCP ``port`` to ``destination`` (a pod, or an address outside the cluster)
    as far as its own namespace's Egress policies go? A pod no Egress policy selects may go anywhere;
    a pod destination matches pod/namespace selectors, an address only ``ipBlock``s."""
    selecting = [p for p in policies if p["metadata"].get("namespace", "team-a") == source.namespace
                 and "Egress" in p["spec"].get("policyTypes", [])
                 and selects(p["spec"]["podSelector"], source.labels)]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("egress") or []:
            ports = rule.get("ports")
            if ports and not any(q.get("port") in (None, port) and q.get("protocol", "TCP") == "TCP" for q in ports):
                continue
            peers = rule.get("to")
            if not peers:
                return True
            namespace = p["metadata"].get("namespace", "team-a")
            if any(_ip_peer_admits(peer, destination) if isinstance(destination, str)
                   else "ipBlock" not in peer and _peer_admits(peer, namespace, destination) for peer in peers):
                return True
    return False
