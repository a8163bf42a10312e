"""The operator's only door to the Kubernetes API: a tiny generic REST client over any kind.

Manifests are plain dicts, so one client serves Pods, Services, ConfigMaps, our custom resources,
PodGroups and PyTorchJobs alike. Auth and TLS come from the ``kubernetes`` package's
configuration (kubeconfig or in-cluster service account).
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import ApiClient, ApiException

from .ratelimit import RateLimit

Manifest = dict[str, Any]

PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Node": "nodes",
    "Namespace": "namespaces",
    "RLExperiment": "rlexperiments",
    "InferencePool": "inferencepools",
    "TrainerJob": "trainerjobs",
    "PodGroup": "podgroups",
    "PyTorchJob": "pytorchjobs",
    "Deployment": "deployments",
}
CLUSTER_SCOPED = {"Node", "Namespace"}


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """REST path of a collection (``name`` None) or of one object."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = "" if kind in CLUSTER_SCOPED or namespace is None else f"/namespaces/{namespace}"
    path = f"{prefix}{ns}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class Kube:
    """Create / get / list / patch / delete plain-dict objects. 404 on get is ``None``."""

    def __init__(self, client: ApiClient, timeout: float = 30.0, limit: RateLimit | None = None):
        self._client = client
        self._timeout = timeout  # seconds per call: a hung call fails, and the sync is retried
        self._limit = limit  # every call waits its turn (``ratelimit``); None: no client-side limit

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        if self._limit is not None:
            self._limit.acquire()
        return self._client.call_api(
            path, method, query_params=query or [], body=body,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True,
            _request_timeout=(self._timeout, self._timeout),
        )

    def create(self, obj: Manifest) -> Manifest:
        meta = obj["metadata"]
        return self._call("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        try:
            return self._call("GET", resource_path(api_version, kind, namespace, name))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def read(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        """``get`` from the API server itself (a cache in front of ``get`` does not answer this, and what
        it returns is not cached: it may be someone else's object, outside what the watches deliver)."""
        return Kube.get(self, api_version, kind, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str | None, selector: dict[str, str]) -> list[Manifest]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        return self._call("GET", resource_path(api_version, kind, namespace), query=query).get("items", [])

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: Manifest,
              subresource: str | None = None) -> Manifest:
        path = resource_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self._call("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False if it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", resource_path(api_version, kind, namespace, name), body)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise
