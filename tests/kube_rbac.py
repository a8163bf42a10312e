"""RBAC as the API server's authorizer applies it, for the emulator: the chart's rendered Roles and
ClusterRoles, bound to the operator's ServiceAccount, as a set of grants. A Role grants in its own
namespace; a ClusterRole bound by a ClusterRoleBinding grants in every namespace and on cluster-scoped
resources; a request across all namespaces (a cluster-wide list or watch) needs a cluster grant."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kuberl"
HELM = ROOT / ".venv" / "bin" / "helm"
RELEASE_NAMESPACE = "kuberl-system"
OPERATOR_TOKEN = "kuberl-operator"  # the bearer token the operator's kubeconfig carries in the tests
INTEGRATIONS = ("kubeflowTraining", "kubeflowTrainer", "volcano", "coscheduling")  # every one the tests use


@dataclass(frozen=True)
class Grants:
    """(API group, resource[/subresource], verb, namespace or None for cluster-wide) granted."""

    rules: frozenset[tuple[str, str, str, str | None]]

    def allows(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        if (group, resource, verb, None) in self.rules:
            return True
        return namespace is not None and (group, resource, verb, namespace) in self.rules


def _expanded(rules: list[dict[str, Any]], namespace: str | None) -> set[tuple[str, str, str, str | None]]:
    return {(group, resource, verb, namespace) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def grants_of(docs: list[dict[str, Any]], service_account: str) -> Grants:
    """What ``service_account`` (in the release namespace) may do, from rendered chart ``docs``."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules") or []
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    granted: set[tuple[str, str, str, str | None]] = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account
                   and s.get("namespace") == RELEASE_NAMESPACE for s in binding.get("subjects") or []):
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role_namespace = namespace if ref["kind"] == "Role" else None
        granted |= _expanded(roles.get((ref["kind"], role_namespace, ref["name"]), []), namespace)
    return Grants(frozenset(granted))


@functools.lru_cache(maxsize=8)
def operator_grants(namespaces: tuple[str, ...] | None) -> Grants:
    """The chart's RBAC for an operator watching ``namespaces`` (None: the whole cluster), every
    integration on."""
    scope = ["--set", "clusterWide=true"] if namespaces is None else [
        "--set", "watchNamespaces={" + ",".join(namespaces) + "}"]
    args = [arg for name in INTEGRATIONS for arg in ("--set", f"integrations.{name}=true")]
    done = subprocess.run([str(HELM), "template", "kuberl", str(CHART), "--namespace", RELEASE_NAMESPACE,
                           *scope, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    return grants_of(docs, account)
