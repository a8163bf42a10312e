"""Validate one manifest document: schema (pydantic) first, then cross-field rules (resolve).

``validate_document`` never raises on bad input; it returns ``FieldIssue``s whose paths use the
YAML (camelCase) names and whose messages name what is allowed.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .base import GROUP_VERSION, shown
from .fields import where_it_belongs
from .resolve import FieldIssue, resolve
from .resources import KINDS, InferencePool, Resource, RLExperiment, TrainerJob
from .rewards import reward_issue
from .sources import RewardSpec
from .storage import cluster_issues, standalone_issues
from .support import unsupported_issues

# A value people write for a field that has a better place: (field path suffix, value) → the hint.
VALUE_HINTS = {
    ("scheduling.gang", "kueue"): "Kueue is not a gang scheduler here: leave gang unset (none) and set "
                                  "scheduling.queue to the LocalQueue (Kueue then admits the experiment's pods "
                                  "as one group)",
}


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
        return f"got {shown(given)}; allowed: {expected}{_value_hint(_path(err['loc']), given, expected)}"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if isinstance(given, str | int | float | bool) and kind != "value_error":
        return f"got {shown(given)}: {msg}"
    return msg


def _value_hint(path: str, given: Any, expected: str) -> str:
    """What to say after the allowed values: YAML's booleans, a value with a better place
    (:data:`VALUE_HINTS`), or the closest allowed spelling."""
    if isinstance(given, bool):
        return " (YAML reads an unquoted on, off, yes or no as a boolean: quote the value, e.g. \"on\")"
    text = str(given).lower()
    for (suffix, value), hint in VALUE_HINTS.items():
        if path.endswith(suffix) and text == value:
            return f" ({hint})"
    close = difflib.get_close_matches(text, re.findall(r"'([^']*)'", expected), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


M = TypeVar("M", bound=BaseModel)


def standalone_sections(doc: dict[str, Any], key: str, model: type[M]) -> list[tuple[str, M]]:
    """(field path, parsed) of ``spec.<key>`` and ``spec.evaluation.<key>`` in a raw RLExperiment
    document, each that parses as ``model`` on its own (one that does not: the schema's issues name it)."""
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    evaluation = spec.get("evaluation") if isinstance(spec.get("evaluation"), dict) else {}
    found = []
    for field, raw in ((f"spec.{key}", spec.get(key)), (f"spec.evaluation.{key}", evaluation.get(key))):
        try:
            found.append((field, model.model_validate(raw)))
        except ValidationError:
            continue
    return found


def section_issues(doc: dict[str, Any]) -> list[FieldIssue]:
    """Checks of an RLExperiment's sections that stand alone, for a document whose schema failed
    elsewhere: so that one run of ``kuberl validate`` says everything (today: a ``kuberl.rewards`` name
    KubeRL does not ship, in ``spec.reward`` and ``spec.evaluation.reward``)."""
    return [FieldIssue(f"{field}.function", message) for field, reward in standalone_sections(doc, "reward", RewardSpec)
            if (message := reward_issue(reward.function))]


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
        return None, schema_issues(err, KINDS[kind]) + (section_issues(doc) if kind == RLExperiment.KIND else [])
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
