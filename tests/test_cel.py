"""The CRDs' CEL rules (x-kubernetes-validations), evaluated by a real CEL implementation
(cel-python), agree with `kuberl validate` on good and bad manifests: what one refuses, the other
refuses. The emulator cannot run them; a real API server would."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from kuberl.api import InferencePool, validate_document

from .conftest import MINIMAL, ROOT


def crd_schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / f"crds/kuberl.io_{plural}.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


ROOT_SCHEMA = crd_schema("rlexperiments")
POOL_SCHEMA = crd_schema("inferencepools")


def rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, str]]:
    """(path of the object the rule is on, rule, message) for every rule in the schema."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule["rule"], rule.get("message", "")
    for name, child in (schema.get("properties") or {}).items():
        yield from rules(child, (*path, name))
    if "items" in schema:  # a rule on a list's items applies to each item
        yield from rules(schema["items"], (*path, "[]"))


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The object as the API server validates it: schema defaults applied first (structural defaulting)."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, child in schema["properties"].items():
            if name not in out and "default" in child:
                out[name] = copy.deepcopy(child["default"])
            if name in out:
                out[name] = with_defaults(child, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], item) for item in value]
    return value


def _at(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def _nodes(doc: Any, path: tuple[str, ...]) -> list[Any]:
    """What ``path`` reaches in ``doc`` ("[]": every item of a list); missing parts reach nothing."""
    if not path:
        return [] if doc is None else [doc]
    head, rest = path[0], path[1:]
    if head == "[]":
        return [n for item in doc for n in _nodes(item, rest)] if isinstance(doc, list) else []
    return _nodes(doc.get(head) if isinstance(doc, dict) else None, rest)


def cel_failures(doc: dict[str, Any], old: dict[str, Any] | None = None,
                 schema: dict[str, Any] = ROOT_SCHEMA) -> list[str]:
    """Messages of the rules that evaluate to false (the API server would refuse the object).
    Transition rules (those using ``oldSelf``) run only on an update, i.e. when ``old`` is given."""
    doc = with_defaults(schema, doc)
    old = with_defaults(schema, old) if old is not None else None
    env = celpy.Environment()
    failed = []
    for path, rule, message in rules(schema):
        if "oldSelf" in rule:  # transition rules: on an update, where the object and its old self are
            pairs = [(_at(doc, path), _at(old, path))] if old is not None and "[]" not in path else []
        else:
            pairs = [(node, None) for node in _nodes(doc, path)]
        for node, before in pairs:
            if node is None or ("oldSelf" in rule and before is None):
                continue
            activation = {"self": celpy.json_to_cel(node)}
            if before is not None:
                activation["oldSelf"] = celpy.json_to_cel(before)
            if not bool(env.program(env.compile(rule)).evaluate(activation)):
                failed.append(message or rule)
    return failed


def experiment(name: str = "demo", **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(MINIMAL)
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


CASES = {
    "minimal": experiment(),
    "30-char name": experiment("a" * 30),
    "31-char name": experiment("a" * 31),
    "40-char name": experiment("b" * 40),
    "leading digit": experiment("9lives"),
    "clip inverted": experiment(algorithm={"clip": {"low": 0.3, "high": 0.2}}),
    "clip fine": experiment(algorithm={"clip": {"low": 0.2, "high": 0.28}}),
    "batch not a multiple of the group": experiment(algorithm={"batchSize": 12, "groupSize": 8}),
    "importance sampling bounds inverted": experiment(algorithm={"importanceSampling": {"low": 2.0},
                                                                 "behaviorImpCap": 0.5}),
    "importance sampling two-sided mask": experiment(algorithm={"importanceSampling": {"low": 0.5},
                                                                "behaviorImpCap": 2.0}),
    "truncation with a lower bound": experiment(algorithm={"importanceSampling": {"mode": "truncate", "low": 0.5}}),
    "truncation at a sequence's geometric mean": experiment(algorithm={
        "importanceSampling": {"mode": "truncate", "level": "geometric"}, "behaviorImpCap": 2.0, "ratio": "sequence"}),
    "warm-up as long as the run": experiment(algorithm={"warmupSteps": 1000}),
    "warm-up shorter than the run": experiment(algorithm={"warmupSteps": 10, "maxSteps": 20}),
    "a critic without ppo": experiment(algorithm={"critic": {"gamma": 0.99}}),
    "ppo with a critic": experiment(algorithm={"name": "ppo", "critic": {"gamma": 0.99, "gaeLambda": 0.95}}),
    "ppo with GSPO's sequence ratio": experiment(algorithm={"name": "ppo", "ratio": "sequence"}),
    "a clip anchored to the behaviour policy": experiment(algorithm={"clip": {"anchor": "behavior"}}),
    "a behaviour anchor with GSPO's ratio": experiment(algorithm={"clip": {"anchor": "behavior"}, "ratio": "sequence"}),
    "a behaviour anchor with sequence-level correction": experiment(algorithm={
        "clip": {"anchor": "behavior"}, "importanceSampling": {"level": "sequence"}}),
    "an automatic anchor with GSPO's ratio": experiment(algorithm={"clip": {"anchor": "auto"}, "ratio": "sequence"}),
    "an adapter on every linear layer": experiment(trainer={"lora": {"rank": 8, "targetModules": ["all-linear"]}}),
    "an adapter on every linear layer and one more": experiment(trainer={"lora": {
        "rank": 8, "targetModules": ["all-linear", "q_proj"]}}),
    "autoscale within bounds": experiment(inference={"replicas": 1, "autoscale": {"maxReplicas": 3}}),
    "autoscale bounds inverted": experiment(inference={"replicas": 1, "autoscale": {"minReplicas": 4,
                                                                                     "maxReplicas": 3}}),
    "autoscale in a Kueue queue": experiment(inference={"replicas": 1, "autoscale": {"maxReplicas": 3}},
                                             scheduling={"queue": "team-a"}),
    "autoscale in a Volcano queue": experiment(inference={"replicas": 1, "autoscale": {"maxReplicas": 3}},
                                               scheduling={"queue": "team-a", "gang": "volcano"}),
    "relay over p2p": experiment(weightSync={"mode": "p2p", "relay": True}),
    "relay over the default mode": experiment(weightSync={"relay": True}),
    "relay over broadcast": experiment(weightSync={"mode": "broadcast", "relay": True}),
    "agent env with a value": experiment(agent={"command": ["a"], "env": [{"name": "X", "value": "1"}]}),
    "agent env with a value and a secret": experiment(agent={"command": ["a"], "env": [
        {"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
    "agent env with neither": experiment(agent={"command": ["a"], "env": [{"name": "X"}]}),
    "agent env with the experiment's API token": experiment(agent={"command": ["a"], "env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "demo-api-token", "key": "token"}}}]}),
    "agent env with another experiment's secret": experiment(agent={"command": ["a"], "env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "judge-api-key", "key": "token"}}}]}),
    **{f"example {p.stem}": d for p in sorted((ROOT / "examples").glob("*.yaml"))
       for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == "RLExperiment"},
}


def test_the_generated_crd_carries_rules():
    assert len(list(rules(ROOT_SCHEMA))) >= 3


@pytest.mark.parametrize("case", list(CASES))
def test_cel_and_kuberl_validate_agree(case):
    doc = CASES[case]
    _, issues = validate_document(doc)
    failures = cel_failures(doc)
    schema_level = [i for i in issues if i.path.startswith(("metadata", "spec.algorithm", "spec.agent",
                                                            "spec.trainer.lora.targetModules",
                                                            "spec.inference.autoscale", "spec.weightSync"))]
    assert bool(failures) == bool(schema_level), (case, failures, issues)


def test_model_path_is_immutable_on_update_only():
    doc = experiment()
    moved = copy.deepcopy(doc)
    moved["spec"]["model"]["path"] = "s3://models/another/"
    assert cel_failures(moved) == []  # a create: no old object
    assert any("model.path cannot change" in m for m in cel_failures(moved, old=doc))
    tuned = copy.deepcopy(doc)
    tuned["spec"]["algorithm"] = {"learningRate": 1e-5}
    assert cel_failures(tuned, old=doc) == []  # other fields may change


def resized(doc: dict[str, Any], replicas: int, suspend: bool | None = None) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["spec"].setdefault("inference", {})["replicas"] = replicas
    if suspend is not None:
        out["spec"]["suspend"] = suspend
    return out


@pytest.mark.parametrize(("scheduling", "refused"), [({"queue": "team-a"}, True),
                                                     ({"queue": "team-a", "gang": "volcano"}, False), ({}, False)])
def test_a_running_experiment_in_a_kueue_queue_keeps_its_size_until_suspended(scheduling, refused):
    """Kueue admits a pod group at one size (the total count on every pod) and evicts the group or deletes
    pods past it when more come: kubectl scale (which writes spec.inference.replicas through the same
    validation) is refused while such an experiment runs, allowed once it is suspended (no pods: the
    group is admitted again at its new size on resume); a Volcano PodGroup or no queue follows a resize."""
    running = resized(experiment(scheduling=scheduling), 2)
    grown = resized(running, 3)
    assert cel_failures(grown) == []  # a create: no old object
    messages = cel_failures(grown, old=running)
    assert bool(messages) == refused and all("inference.replicas cannot change" in m for m in messages)
    suspended = resized(running, 2, suspend=True)
    assert cel_failures(resized(suspended, 3), old=suspended) == []
    assert bool(cel_failures(resized(running, 3, suspend=True), old=running)) == refused  # suspend first
    assert cel_failures(resized(running, 2, suspend=True), old=running) == []


@pytest.mark.parametrize(("owned", "refused"), [(False, True), (True, False)])
def test_a_standalone_pool_in_a_kueue_queue_keeps_its_size_until_suspended(owned, refused):
    """A standalone pool's pods are its own Kueue pod group; an experiment's pool follows the experiment
    (whose own rule holds the size), so the operator can resize it after a suspension."""
    running = pool(replicas=2, scheduling={"queue": "team-a"}, **({"gang": {"group": "demo", "members": 3}}
                                                                  if owned else {}))
    grown = running | {"spec": running["spec"] | {"replicas": 3}}
    messages = cel_failures(grown, old=running, schema=POOL_SCHEMA)
    assert bool(messages) == refused and all("replicas cannot change" in m for m in messages)
    suspended = running | {"spec": running["spec"] | {"suspend": True}}
    assert cel_failures(suspended | {"spec": suspended["spec"] | {"replicas": 3}}, old=suspended,
                        schema=POOL_SCHEMA) == []


def openapi_failures(doc: dict[str, Any], schema: dict[str, Any] = ROOT_SCHEMA) -> list[str]:
    """What the API server's OpenAPI validation refuses (bounds, patterns, types), via jsonschema:
    a structural schema is OpenAPI v3.0, i.e. JSON Schema draft 4 plus x-kubernetes-* extensions."""
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:80]}" for e in validator.iter_errors(
        with_defaults(schema, doc))]


@pytest.mark.parametrize(("case", "field"), [
    (experiment(inference={"replicas": 100_000}), "spec.inference.replicas"),
    (experiment(trainer={"nodes": 100_000}), "spec.trainer.nodes"),
    (experiment(inference={"image": "repo/image:tag; rm -rf /"}), "spec.inference.image"),
    (experiment(inference={"nodeSelector": {"k" * 400: "v"}}), "spec.inference.nodeSelector"),
    (experiment(scheduling={"queue": "Team Queue"}), "spec.scheduling.queue"),
])
def test_the_crd_itself_refuses_what_cannot_work_and_kuberl_validate_agrees(case, field):
    refused = openapi_failures(case) + cel_failures(case)
    assert refused, f"the CRD accepts {field}"
    _, issues = validate_document(case)
    assert any(i.path.startswith(field) for i in issues), (field, issues)
    assert openapi_failures(experiment()) == [] and cel_failures(experiment()) == []


def pool(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "big", "namespace": "team-a"}, "spec": {"engine": "torch", **spec}}


@pytest.mark.parametrize(("spec", "fits"), [
    ({"replicas": 1024, "hostsPerReplica": 1000}, False),  # each field within its own bound, 1,024,000 pods
    ({"replicas": 2, "hostsPerReplica": 513}, False),
    ({"hostsPerReplica": 10**6}, False),
    ({"replicas": 1024}, True),
    ({"replicas": 4, "hostsPerReplica": 256}, True),
])
def test_a_pool_is_bounded_in_pods_by_the_crd_and_by_the_model_the_operator_reads(spec, fits):
    """One object must not make the operator build a million pods: the CRD refuses it (OpenAPI bound
    or CEL rule) and so does the model every reconcile parses it with, naming the fields."""
    doc = pool(**spec)
    refused = openapi_failures(doc, POOL_SCHEMA) + cel_failures(doc, schema=POOL_SCHEMA)
    assert bool(refused) != fits, refused
    if fits:
        InferencePool.model_validate(doc)
        return
    with pytest.raises(ValidationError) as err:
        InferencePool.model_validate(doc)
    assert "hostsPerReplica" in str(err.value) or "hosts_per_replica" in str(err.value)


@pytest.mark.parametrize("trainer", [{"runtime": "trainjob"}, {"runtime": "kubeflow"}, {}])
def test_every_example_and_runtime_validates_as_the_api_server_stores_it_with_the_crds_defaults(trainer):
    """The API server fills in the CRD's defaults before anyone reads an object: a rule that asks whether
    a field was set (rather than what it holds) would then refuse what validate admitted — trainer.backoffLimit
    with the trainjob runtime once did. Every example, as stored, validates as it did before storing."""
    docs = [copy.deepcopy(d) for name, d in CASES.items() if name.startswith("example ")]
    for doc in docs:
        doc["spec"].setdefault("trainer", {}).update(trainer)
        doc["spec"].pop("scheduling", None)  # a trainjob carries no gang (refused, tested elsewhere)
        before = [i.path for i in validate_document(doc)[1]]
        stored = with_defaults(ROOT_SCHEMA, doc)
        assert [i.path for i in validate_document(stored)[1]] == before, doc["metadata"]["name"]
