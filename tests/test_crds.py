"""The checked-in CRDs are generated from the models, structural, and carry the printer columns."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kuberl.api.crd import render_crds

from .conftest import ROOT


def test_checked_in_crds_are_fresh():
    for name, text in render_crds().items():
        for path in (ROOT / "crds" / name, ROOT / "charts/kuberl/crds" / name):
            assert path.exists(), f"{path} missing: run `kuberl crds`"
            assert path.read_text() == text, f"{path} is stale: run `kuberl crds` and commit"


def _walk(node: Any, path: str = "") -> list[str]:
    """Structural-schema violations (apiextensions.k8s.io rules we can check offline)."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return problems
    if "$ref" in node or "anyOf" in node or "allOf" in node:
        problems.append(f"{path}: $ref/anyOf/allOf are not allowed")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if "type" not in node and not node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path}: no type")
    for key, child in node.get("properties", {}).items():
        problems += _walk(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _walk(node[key], f"{path}[{key}]")
    return problems


def test_schemas_are_structural():
    for text in render_crds().values():
        crd = yaml.safe_load(text)
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert _walk(schema) == []


def test_names_columns_and_defaults():
    crds = {yaml.safe_load(t)["spec"]["names"]["kind"]: yaml.safe_load(t) for t in render_crds().values()}
    assert {k: c["spec"]["names"]["shortNames"] for k, c in crds.items()} == {
        "RLExperiment": ["rlx"], "InferencePool": ["rlpool"], "TrainerJob": ["rltrain"],
    }
    rlx = crds["RLExperiment"]["spec"]["versions"][0]
    assert [c["name"] for c in rlx["additionalPrinterColumns"]] == [
        "Phase", "Step", "Version", "Reward", "Observed-Staleness", "Eval", "Age", "Last-Export",
    ]
    assert rlx["additionalPrinterColumns"][-1]["priority"] == 1  # kubectl get rlx -o wide
    assert set(rlx["subresources"]) == {"status", "scale"}
    spec = rlx["schema"]["openAPIV3Schema"]["properties"]["spec"]
    algorithm = spec["properties"]["algorithm"]
    assert algorithm["default"] == {}
    assert algorithm["properties"]["groupSize"]["default"] == 8
    assert algorithm["x-kubernetes-validations"][0]["rule"] == "self.batchSize % self.groupSize == 0"
    assert "default" not in spec["properties"]["inference"]["properties"]["replicas"]
    assert spec["properties"]["inference"]["properties"]["accelerator"]["enum"] == ["nvidia", "ascend", "cpu"]


def schema_at(schema: dict, path: str) -> dict:
    """The schema a JSON path like ``.spec.inference.replicas`` leads to."""
    for part in path.lstrip(".").split("."):
        schema = schema["properties"][part]
    return schema


@pytest.mark.parametrize("kind", ["RLExperiment", "InferencePool"])
def test_the_scale_subresource_points_at_fields_the_schema_has(kind):
    """kubectl scale / an HPA read and write through these paths (the API server answers an error for a
    path the object lacks): replicas are integers, the selector a string — and a TrainerJob has none."""
    crds = {yaml.safe_load(t)["spec"]["names"]["kind"]: yaml.safe_load(t) for t in render_crds().values()}
    version = crds[kind]["spec"]["versions"][0]
    scale, root = version["subresources"]["scale"], version["schema"]["openAPIV3Schema"]
    assert scale["specReplicasPath"].startswith(".spec.") and scale["statusReplicasPath"].startswith(".status.")
    assert schema_at(root, scale["specReplicasPath"])["type"] == "integer"
    assert schema_at(root, scale["statusReplicasPath"])["type"] == "integer"
    assert schema_at(root, scale["labelSelectorPath"])["type"] == "string"
    assert "scale" not in crds["TrainerJob"]["spec"]["versions"][0]["subresources"]


def test_every_field_of_every_kind_says_what_it_is():
    """`kubectl explain` shows each field's description: none is bare (a new field without one fails here)."""
    def bare(node: dict, path: str) -> list[str]:
        found = []
        for name, prop in (node.get("properties") or {}).items():
            here = f"{path}.{name}"
            found += [here] if not prop.get("description") else []
            found += bare(prop, here) + bare(prop.get("items") or {}, f"{here}[]")
        return found

    for name, text in render_crds().items():
        schema = yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert bare(schema, "") == [], name


def test_the_field_reference_is_fresh_and_lists_every_field():
    from kuberl.api.reference import REFERENCE_PATH, render_reference

    text = render_reference()
    assert (ROOT / REFERENCE_PATH).read_text() == text, f"{REFERENCE_PATH} is stale: run `kuberl crds` and commit"
    for field in ("spec.algorithm.maxSteps", "spec.scheduling.gang", "spec.seed", "spec.suspend",
                  "status.progress.evalVersionSpan", "spec.inference.tolerations[].effect"):
        assert f"| `{field}` |" in text, field
