"""Generate CustomResourceDefinitions from the pydantic models (the controller-gen pattern).

``python -m kuberl.api.crd crds/`` rewrites ``crds/*.yaml``; a test fails when they are stale.
The JSON schema pydantic produces is made *structural* for Kubernetes: ``$ref`` inlined,
``anyOf[X, null]`` collapsed to ``X``, titles dropped, maps as ``additionalProperties``,
numeric ``exclusiveMinimum``/``Maximum`` turned into OpenAPI v3.0's boolean form, and CEL rules
(``x-kubernetes-validations``) kept. ``tests/test_chart.py`` validates the result against the
Kubernetes API schemas (kubernetes-validate).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from .base import API_GROUP, API_VERSION
from .contract import API_TOKEN_SUFFIX
from .resources import DNS1035_LABEL, EXPERIMENT_NAME_MAX, KINDS, Resource

_DROP = {"title", "discriminator"}

PRINTER_COLUMNS: dict[str, list[dict[str, str]]] = {
    "RLExperiment": [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
        {"name": "Version", "type": "integer", "jsonPath": ".status.progress.version"},
        {"name": "Reward", "type": "number", "jsonPath": ".status.progress.reward"},
        {"name": "Observed-Staleness", "type": "integer", "jsonPath": ".status.progress.observedStaleness"},
        {"name": "Eval", "type": "number", "jsonPath": ".status.progress.evalReward"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Last-Export", "type": "string", "jsonPath": ".status.progress.lastExport", "priority": 1},
    ],
    "InferencePool": [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Accelerator", "type": "string", "jsonPath": ".spec.accelerator"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    "TrainerJob": [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
        {"name": "Nodes", "type": "integer", "jsonPath": ".spec.nodes"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
        {"name": "Preemptions", "type": "integer", "jsonPath": ".status.preemptions"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}


def _key_rules(names: dict[str, Any]) -> list[dict[str, str]]:
    """CEL rules over a map's keys for a JSON-schema ``propertyNames``."""
    rules = []
    if "maxLength" in names:
        rules.append({"rule": f"self.all(k, k.size() <= {names['maxLength']})",
                      "message": f"keys: at most {names['maxLength']} characters"})
    if names.get("minLength"):
        rules.append({"rule": f"self.all(k, k.size() >= {names['minLength']})", "message": "keys: must not be empty"})
    return rules


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite a pydantic JSON-schema node into a Kubernetes structural-schema node."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            return _structural({**options[0], **rest}, defs)
        raise ValueError(f"cannot express anyOf with several types in a CRD: {node}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema's numeric form → OpenAPI v3.0's (what the API server accepts):
            # exclusiveMinimum: x  ⇒  minimum: x, exclusiveMinimum: true
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas forbid it beside properties; pruning does the job
        elif key == "properties":
            required = set(node.get("required", []))
            out[key] = {
                k: _with_empty_default(v, k in required, _structural(v, defs))
                for k, v in value.items()
            }
        elif key == "propertyNames":  # not allowed in a structural schema: the same bounds as CEL rules
            out.setdefault("x-kubernetes-validations", []).extend(_key_rules(value))
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _with_empty_default(raw: dict[str, Any], required: bool, node: dict[str, Any]) -> dict[str, Any]:
    """A non-optional nested object defaults to ``{}`` so the API server fills its defaults."""
    if not required and "$ref" in raw and node.get("type") == "object" and "default" not in node:
        return {**node, "default": {}}
    return node


def openapi_schema(model: type[Resource], part: str) -> dict[str, Any]:
    """Structural schema of ``spec`` or ``status`` of one kind."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.get("$defs", {})
    node = _structural(schema["properties"][part], defs)
    if part == "status":
        # kopf and other controllers may keep bookkeeping next to ours.
        node["x-kubernetes-preserve-unknown-fields"] = True
    return node


NAME_RULES = {  # the API server checks what the pydantic model checks (RLExperiment's validators)
    "RLExperiment": [
        {"rule": f"self.metadata.name.size() <= {EXPERIMENT_NAME_MAX}",
         "message": f"metadata.name: at most {EXPERIMENT_NAME_MAX} characters (children add '-inference')"},
        {"rule": f"self.metadata.name.matches('{DNS1035_LABEL}')",
         "message": "metadata.name: must start with a letter (Service names derive from it)"},
        {"rule": "!has(self.spec.agent) || !has(self.spec.agent.env) || self.spec.agent.env.all(e, "
                 f"!has(e.valueFrom) || e.valueFrom.secretKeyRef.name != self.metadata.name + '{API_TOKEN_SUFFIX}')",
         "message": "spec.agent.env: the experiment's API token Secret is not the agent's to read"},
    ],
}


SCALE = {  # kubectl scale / an HPA / KEDA resize inference through these (autoscaling/v1 Scale)
    "RLExperiment": {"specReplicasPath": ".spec.inference.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"},
    "InferencePool": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                      "labelSelectorPath": ".status.selector"},
}


# Kubernetes' own texts for every object's first three fields (as controller-gen writes them, shortened).
API_VERSION_TEXT = "the versioned schema of this representation of an object: kuberl.io/v1alpha1"
KIND_TEXT = "the REST resource this object represents"
METADATA_TEXT = "standard object metadata: name, namespace, labels, annotations"


def subresources(kind: str) -> dict[str, Any]:
    """Every kind's ``status``; ``scale`` where inference can be resized (``SCALE``)."""
    return {"status": {}, **({"scale": SCALE[kind]} if kind in SCALE else {})}


def build_crd(model: type[Resource]) -> dict[str, Any]:
    spec_schema = openapi_schema(model, "spec")
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{model.PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": model.KIND,
                "listKind": f"{model.KIND}List",
                "plural": model.PLURAL,
                "singular": model.KIND.lower(),
                "shortNames": [model.SHORT_NAME],
                "categories": ["kuberl"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources(model.KIND),
                    "additionalPrinterColumns": PRINTER_COLUMNS[model.KIND],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            **({"x-kubernetes-validations": NAME_RULES[model.KIND]}
                               if model.KIND in NAME_RULES else {}),
                            "properties": {
                                "apiVersion": {"type": "string", "description": API_VERSION_TEXT},
                                "kind": {"type": "string", "description": KIND_TEXT},
                                "metadata": {"type": "object", "description": METADATA_TEXT},
                                "spec": spec_schema,
                                "status": openapi_schema(model, "status"),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crds() -> dict[str, str]:
    """File name → YAML text for every kind."""
    header = "# Generated by `python -m kuberl.api.crd crds/` from kuberl.api; do not edit.\n"
    return {
        f"{API_GROUP}_{model.PLURAL}.yaml": header + yaml.safe_dump(build_crd(model), sort_keys=False)
        for model in KINDS.values()
    }


CHART_CRDS = Path("charts/kuberl/crds")  # Helm installs these before the chart's templates


def main(argv: list[str]) -> int:
    """Write the CRDs to ``argv[0]`` (default ``crds/``, and then also the chart's copy and the field
    reference, ``docs/reference.md``)."""
    from .reference import REFERENCE_PATH, render_reference

    outs = [Path(argv[0])] if argv else [Path("crds"), CHART_CRDS]
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in render_crds().items():
            (out / name).write_text(text)
            print(f"wrote {out / name}")
    if not argv:
        Path(REFERENCE_PATH).write_text(render_reference())
        print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
