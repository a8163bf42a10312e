"""Pure functions on Kubernetes API objects, as the emulated API server (``kube_emulator``) applies
them: JSON copies, RFC 7386 merge patches, label and field selectors, and the JSON paths and ages
``kubectl get`` columns show."""

from __future__ import annotations

import datetime
import re
from typing import Any

Obj = dict[str, Any]


def json_copy(value: Any) -> Any:
    """A copy of a JSON value: ``copy.deepcopy`` for dicts, lists and scalars, three times faster
    (every object the server stores, logs or answers is copied)."""
    if type(value) is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if type(value) is list:
        return [json_copy(v) for v in value]
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return json_copy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


_SET_RE = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def matches_labels(labels: dict[str, str], selector: str | None) -> bool:
    """Kubernetes label-selector semantics for the string forms kubectl and clients send."""
    for term in _split_selector(selector or ""):
        if m := _SET_RE.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (labels.get(key) in values):
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def matches_fields(obj: Obj, selector: str | None) -> bool:
    for term in _split_selector(selector or ""):
        key, _, value = term.replace("==", "=").partition("=")
        negate = key.endswith("!")
        key = key.rstrip("!")
        actual = {"metadata.name": obj["metadata"].get("name"),
                  "metadata.namespace": obj["metadata"].get("namespace")}.get(key)
        if (actual == value) == negate:
            return False
    return True


def now_timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def json_path(obj: Obj, path: str) -> Any:
    node: Any = obj
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def with_json_path(obj: Obj, path: str, value: Any) -> Obj:
    """A copy of ``obj`` with ``value`` at ``path`` (``.spec.inference.replicas``), objects made on the way."""
    out = json_copy(obj)
    *parents, last = path.strip(".").split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def scale_of(obj: Obj, paths: Obj) -> Obj:
    """The autoscaling/v1 Scale a custom resource's scale subresource answers (``paths``: its CRD's
    specReplicasPath, statusReplicasPath, labelSelectorPath). No value at specReplicasPath: None (the
    API server answers an error); none at the others: 0 and "" (as it does)."""
    replicas = json_path(obj, paths["specReplicasPath"])
    if replicas is None:
        return None
    meta = obj["metadata"]
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": replicas},
            "status": {"replicas": json_path(obj, paths["statusReplicasPath"]) or 0,
                       "selector": json_path(obj, paths.get("labelSelectorPath", ".status.none")) or ""}}
