"""JSON over HTTP for the commands that read a running experiment (``kuberl top``, ``kuberl postmortem``): a
trainer's or replica's endpoints, and the Kubernetes API as ``kubectl proxy`` serves it (the user's kubeconfig
and rights; nothing to authenticate here)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kuberl.api import API_GROUP, API_VERSION


def get_json(url: str, timeout: float) -> tuple[int, Any]:
    """(HTTP status, JSON body) of a GET; an error status still gives its body."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def read_object(url: str, timeout: float) -> dict[str, Any]:
    """The object at ``url``; a ValueError naming the URL, the status and the server's message otherwise."""
    code, body = get_json(url, timeout)
    if code != 200:
        message = body.get("message", body) if isinstance(body, dict) else body
        raise ValueError(f"{url}: HTTP {code}: {message}")
    return body


def experiment_url(api: str, namespace: str, name: str) -> str:
    """An RLExperiment's URL under ``kubectl proxy`` at ``api``."""
    return f"{api.rstrip('/')}/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/rlexperiments/{name}"


def config_map_url(api: str, namespace: str, name: str) -> str:
    """A ConfigMap's URL under ``kubectl proxy`` at ``api``."""
    return f"{api.rstrip('/')}/api/v1/namespaces/{namespace}/configmaps/{name}"
