"""Validate one manifest document: schema (pydantic) first, then cross-field rules (resolve).

``validate_document`` never raises on bad input; it returns ``FieldIssue``s whose paths use the
YAML (camelCase) names and whose messages name what is allowed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from .base import GROUP_VERSION, shown
from .fields import where_it_belongs
from .resolve import FieldIssue, resolve
from .resources import KINDS, InferencePool, Resource, RLExperiment, TrainerJob
from .storage import cluster_issues, standalone_issues
from .support import unsupported_issues


def _path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _explain(err: dict[str, Any], model_fields: dict[str, Any] | None = None) -> str:
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "is required"
    if kind in ("enum", "literal_error"):
        expected = err.get("ctx", {}).get("expected", "")
        hint = (" (YAML reads an unquoted on, off, yes or no as a boolean: quote the value, e.g. \"on\")"
                if isinstance(given, bool) else "")
        return f"got {shown(given)}; allowed: {expected}{hint}"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if isinstance(given, str | int | float | bool) and kind != "value_error":
        return f"got {shown(given)}: {msg}"
    return msg


def schema_issues(err: ValidationError, model: type[BaseModel] | None = None) -> list[FieldIssue]:
    """One issue per schema error; an unknown field also says where that name belongs in ``model``'s
    schema, or the close spellings it may stand for."""
    issues = []
    for e in err.errors():
        path, message = _path(e["loc"]) or "<document>", _explain(e)
        if e["type"] == "extra_forbidden" and model is not None and (hint := where_it_belongs(model, path)):
            message = f"{message}; {hint}"
        issues.append(FieldIssue(path, message))
    return issues


def validate_document(doc: Any, cluster: bool = True) -> tuple[Resource | None, list[FieldIssue]]:
    """Parse and check one decoded YAML document; the object is None when it is invalid.
    ``cluster``: also the rules for pods on a cluster (:mod:`.storage`); ``kuberl run`` leaves them out."""
    if not isinstance(doc, dict):
        return None, [FieldIssue("<document>", f"expected a mapping, got {type(doc).__name__}")]
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or kind not in KINDS:
        allowed = ", ".join(KINDS)
        return None, [FieldIssue("kind", f"got {shown(kind)}; allowed: {allowed}")]
    if api_version != GROUP_VERSION:
        return None, [FieldIssue("apiVersion", f"got {shown(api_version)}; allowed: {GROUP_VERSION}")]
    try:
        obj = KINDS[kind].model_validate(doc)
    except ValidationError as err:
        return None, schema_issues(err, KINDS[kind])
    if isinstance(obj, RLExperiment):
        _, trainer, issues = resolve(obj.spec)
        issues += unsupported_issues(obj.spec, trainer)
        issues += cluster_issues(obj.spec, obj.metadata.name) if cluster else []
        if issues:
            return None, issues
    if isinstance(obj, InferencePool | TrainerJob) and cluster and (
            issues := standalone_issues(obj.spec, obj.metadata.name)):
        return None, issues
    return obj, []
