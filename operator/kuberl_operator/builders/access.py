"""Who may reach an experiment's pods (docs/architecture.md, "Who may call what").

Two locks, both per experiment: a NetworkPolicy (ingress to its pods only from the same
experiment's inference and trainer pods, from its agent pods on the gateway port alone, from the
operator on the trainer's progress port, and from the metrics scraper's namespaces when configured)
and an API token (a Secret the operator creates and owns) that every
state-changing endpoint of the workload's servers requires. With spec.agent, a second token (its
own Secret) is all the agent holds: the gateway accepts it, nothing else does.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from kuberl.api.contract import (
    API_TOKEN_KEY,
    GATEWAY_PORT,
    LABEL_EXPERIMENT,
    LABEL_ROLE,
    PROGRESS_PORT,
    ROLE_AGENT,
    ROLE_INFERENCE,
    ROLE_TRAINER,
    api_token_secret_name,
    network_policy_name,
)

from .common import Manifest, child_metadata

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class Peers:
    """Who outside an experiment may reach it: the operator's pods (namespace + labels) and, when
    configured, the namespaces a metrics scraper runs in (a namespace label selector)."""

    operator_namespace: str = ""
    operator_labels: dict[str, str] = field(default_factory=dict)
    metrics_namespace_labels: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def from_env() -> Peers:
        """The chart sets KUBERL_OPERATOR_NAMESPACE, KUBERL_OPERATOR_LABELS and
        KUBERL_METRICS_NAMESPACE_LABELS (JSON objects); unset means "nobody"."""
        return Peers(
            os.environ.get("KUBERL_OPERATOR_NAMESPACE", ""),
            json.loads(os.environ.get("KUBERL_OPERATOR_LABELS") or "{}"),
            json.loads(os.environ.get("KUBERL_METRICS_NAMESPACE_LABELS") or "{}"),
        )


def network_policy(parent: Manifest, experiment: str, peers: Peers, metrics_ports: list[int]) -> Manifest:
    """Ingress to ``experiment``'s pods: from its inference and trainer pods (any port: collectives,
    stores, weight exchange), from its agent pods on ``GATEWAY_PORT`` only (the agent runs
    model-driven code: it must not reach a torch store or a gloo/NCCL socket), from the operator's
    pods on ``PROGRESS_PORT``, from the scraper's namespaces on ``metrics_ports``. Egress stays open:
    the pods read models and data from S3 and write checkpoints there."""
    own = {LABEL_EXPERIMENT: experiment}
    workload = {"matchLabels": own,
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_INFERENCE, ROLE_TRAINER]}]}
    ingress: list[Manifest] = [
        {"from": [{"podSelector": workload}]},
        {"from": [{"podSelector": {"matchLabels": {**own, LABEL_ROLE: ROLE_AGENT}}}],
         "ports": [{"port": GATEWAY_PORT, "protocol": "TCP"}]},
    ]
    if peers.operator_namespace and peers.operator_labels:
        ingress.append({
            "from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: peers.operator_namespace}},
                      "podSelector": {"matchLabels": dict(peers.operator_labels)}}],
            "ports": [{"port": PROGRESS_PORT, "protocol": "TCP"}],
        })  # fmt: skip
    if peers.metrics_namespace_labels:
        ingress.append({
            "from": [{"namespaceSelector": {"matchLabels": dict(peers.metrics_namespace_labels)}}],
            "ports": [{"port": p, "protocol": "TCP"} for p in sorted(set(metrics_ports))],
        })  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(parent, network_policy_name(experiment), own),
        "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def api_token_secret(parent: Manifest, experiment: str, token: str, name: str | None = None) -> Manifest:
    """The experiment's API token (``name``: another of its tokens, e.g. the agent's Secret
    ``agent_token_secret_name``). Created once and never rewritten (``reconcile.ensure``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(parent, name or api_token_secret_name(experiment), {LABEL_EXPERIMENT: experiment}),
        "stringData": {API_TOKEN_KEY: token},
    }


def token_version(*secrets: Manifest | None) -> str:
    """16 hex digits of SHA-256 over each token Secret's ``uid:resourceVersion`` (an absent one: "-"):
    which tokens a pod reads at start. A Secret deleted and recreated (a new token) or edited (a
    rotated one) gives a new version, and the pods that carry the old one are replaced. Nothing of
    the token itself goes into it."""
    parts = ["-" if s is None else f"{s['metadata'].get('uid')}:{s['metadata'].get('resourceVersion')}"
             for s in secrets]
    return hashlib.sha256(",".join(parts).encode()).hexdigest()[:16]
