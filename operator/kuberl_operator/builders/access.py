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
from kuberl.api.spec import StorageSpec

from ..settings import BuildSettings, Peers
from .common import Manifest, child_metadata

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
# Cloud instance-metadata services: the node's credentials and bootstrap data (AWS, GCP, Azure,
# OpenStack and Oracle at 169.254.169.254, AWS over IPv6, Alibaba). Not all of link-local: NodeLocal
# DNSCache listens on 169.254.20.10.
METADATA_CIDRS_V4 = ("169.254.169.254/32", "100.100.100.200/32")
METADATA_CIDRS_V6 = ("fd00:ec2::254/128",)


def egress_rules(metadata: bool) -> list[Manifest]:
    """Egress: to any pod of the cluster (peers, DNS, an in-cluster object store; their own ingress
    policies decide) and to any address outside it but the cloud metadata services (``metadata``
    True keeps them: GKE's workload identity serves a pod's credentials there)."""
    v4_except, v6_except = ([], []) if metadata else (list(METADATA_CIDRS_V4), list(METADATA_CIDRS_V6))
    return [
        {"to": [{"namespaceSelector": {}}]},
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", **({"except": v4_except} if v4_except else {})}},
                {"ipBlock": {"cidr": "::/0", **({"except": v6_except} if v6_except else {})}}]},
    ]


def metadata_egress(storage: StorageSpec, settings: BuildSettings) -> bool:
    """Whether pods may reach the instance-metadata service: only where the platform admin allows it
    (the chart's ``workloadNetworkPolicy.allowMetadataEgress``) and the pods use a ServiceAccount of
    their own (``spec.storage.serviceAccountName``: workload identity, which GKE serves there)."""
    return settings.allow_metadata_egress and bool(storage.service_account_name)


def network_policy(parent: Manifest, experiment: str, peers: Peers, metrics_ports: list[int],
                   metadata: bool = False, standalone: bool = False) -> Manifest:
    """Ingress to ``experiment``'s pods: from its inference and trainer pods (any port: collectives,
    stores, weight exchange), from its agent pods on ``GATEWAY_PORT`` only (the agent runs
    model-driven code: it must not reach a torch store or a gloo/NCCL socket), from the operator's
    pods on ``PROGRESS_PORT``, from the scraper's namespaces on ``metrics_ports``. ``standalone``: a
    pool's or job's of its own (``experiment`` is its name), whose clients — a trainer, an evaluation
    job — KubeRL does not know: from any pod of its namespace, never another namespace's. Egress
    (``egress_rules``): everywhere the pods read models and data and write checkpoints, but not the
    node's instance-metadata service (the node's cloud credentials) unless ``metadata``."""
    own = {LABEL_EXPERIMENT: experiment}
    workload = {"matchLabels": own,
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_INFERENCE, ROLE_TRAINER]}]}
    ingress: list[Manifest] = [{"from": [{"podSelector": {}}]}] if standalone else [
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
        "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress", "Egress"], "ingress": ingress,
                 "egress": egress_rules(metadata)},
    }


def api_token_secret(parent: Manifest, experiment: str, token: str, name: str | None = None) -> Manifest:
    """The experiment's API token (``name``: another of its tokens, e.g. the agent's Secret
    ``agent_token_secret_name``). Created once and never rewritten (``children.ensure``)."""
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
