"""Traces of a sample's life: a ``sample`` span from admission to the step that trained it (its step and
staleness, as the trainer counts them), with a ``generate`` span per request and the replica's own
``engine`` span joined to it through the request's traceparent; the trainer's ``step`` spans with their
phases; and ``kuberl run`` writing them all to ``<workdir>/traces.jsonl`` (checked by ``check_trace_file`` on
tests/test_local_run.py's chat-math run: one run, its own checks and these)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from .test_rollout_controller import GROUPS, started, take

_EXPORTED = InMemorySpanExporter()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """This process's spans (its tracer provider is set once per process, as OpenTelemetry allows)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTED))
        trace.set_tracer_provider(provider)
    _EXPORTED.clear()
    return _EXPORTED


def test_a_trained_samples_trace_runs_from_admission_through_its_replica_to_its_step(spans):
    with started(1) as (controller, serve):
        batches = []
        for version in range(3):
            batches.append(take(controller, GROUPS, version))
            serve(version + 1)
    finished = spans.get_finished_spans()
    samples = {s.context.span_id: s for s in finished if s.name == "sample"
               and s.attributes.get("kuberl.outcome") == "trained"}
    assert len(samples) == 3 * GROUPS
    trained = {(g.prompt, version, version - g.oldest_version) for version, b in enumerate(batches) for g in b or []}
    assert {(s.attributes["kuberl.prompt"], s.attributes["kuberl.step"], s.attributes["kuberl.staleness"])
            for s in samples.values()} == trained  # the step and staleness the trainer counts
    children = defaultdict(list)
    for span in finished:
        if span.parent is not None:
            children[span.parent.span_id].append(span)
    for sample in samples.values():
        [generate] = [c for c in children[sample.context.span_id] if c.name == "generate"]
        assert generate.attributes["kuberl.replica"].startswith("http://127.0.0.1:")
        assert generate.attributes["kuberl.output_tokens"] > 0
        [engine] = children[generate.context.span_id]  # the replica's span, joined by the traceparent header
        assert engine.name == "engine" and engine.context.trace_id == sample.context.trace_id
        assert engine.attributes["kuberl.version"] == generate.attributes["kuberl.version"]


@pytest.mark.slow  # the gateway's tasks start a process
def test_an_agents_call_joins_the_trace_its_traceparent_names_down_to_the_replicas_engine(spans):
    """An agent instrumented with OpenTelemetry sends ``traceparent`` on its OpenAI calls: the gateway's
    ``agent_turn`` span is a child of the agent's span, and the generation and the replica's engine follow."""
    from kuberl.models.tiny import char_tokenizer, tiny_qwen2

    from .test_gateway import gateway_over

    trace_id, agent_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    tok = char_tokenizer()
    with gateway_over(tiny_qwen2(len(tok), seed=0), tok, batch_size=4, max_staleness=4) as (_, client):
        client.chat.completions.create(model="tiny-agent", max_tokens=4, messages=[{"role": "user", "content": "2*3="}],
                                       extra_headers={"X-KubeRL-Session": "s1", "X-KubeRL-Group": "g",
                                                      "traceparent": f"00-{trace_id}-{agent_span}-01"})
    finished = spans.get_finished_spans()
    [turn] = [s for s in finished if s.name == "agent_turn"]
    assert format(turn.context.trace_id, "032x") == trace_id and format(turn.parent.span_id, "016x") == agent_span
    assert turn.attributes["kuberl.session"] == "s1" and turn.attributes["kuberl.output_tokens"] > 0
    [generate] = [s for s in finished if s.name == "generate" and s.parent.span_id == turn.context.span_id]
    [engine] = [s for s in finished if s.name == "engine" and s.parent.span_id == generate.context.span_id]
    assert engine.context.trace_id == turn.context.trace_id


def check_trace_file(work: Path, summary: dict[str, Any], steps: int, prompts_per_step: int) -> None:
    """``kuberl run``'s ``<workdir>/traces.jsonl`` at ``traceSampleRate: 1`` (tests/test_local_run.py's chat-math
    run writes one): every trained sample's span, its staleness as the trainer counted it, its chain down to a
    replica's engine span and its score (which reward worker, how long the call waited for one), and the trainer's
    step spans with their phases, each linked to the sample spans of what it trained."""
    spans = [json.loads(line) for line in (work / "traces.jsonl").read_text().splitlines()]
    by_id = {s["context"]["span_id"]: s for s in spans}
    trained = [s for s in spans if s["name"] == "sample" and s["attributes"].get("kuberl.outcome") == "trained"]
    assert len(trained) == steps * prompts_per_step  # every prompt's group trained
    assert max(s["attributes"]["kuberl.staleness"] for s in trained) == summary["max_token_staleness_trained"]
    kinds = defaultdict(set)  # a sample span → the names of its spans' chain below it
    for span in spans:
        parent, name = span["parent_id"], span["name"]
        while parent in by_id:
            kinds[parent].add(name)
            parent = by_id[parent]["parent_id"]
    assert all({"generate", "engine", "score"} <= kinds[s["context"]["span_id"]] for s in trained)
    scored = [s["attributes"] for s in spans if s["name"] == "score" and s["attributes"]["kuberl.finished"]
              and "kuberl.reward" in s["attributes"]]  # not those cancelled as the run ended, waiting for a worker
    assert scored and all(a["kuberl.reward_worker"] > 0 and a["kuberl.reward_wait_seconds"] >= 0 for a in scored)
    steps_traced = {s["attributes"]["kuberl.step"]: s for s in spans if s["name"] == "step"}  # the trainer's rank 0
    assert sorted(steps_traced) == list(range(steps))
    exchanges = {s["attributes"]["kuberl.version"]: s for s in spans if s["name"] == "weight_exchange"}
    assert sorted(exchanges) == [step + 1 for step in range(steps)]  # every push, its account a step later
    for version, exchange in exchanges.items():  # under the weight_push span of the step that started it
        assert by_id[exchange["parent_id"]]["name"] == "weight_push"
        assert by_id[by_id[exchange["parent_id"]]["parent_id"]]["attributes"]["kuberl.step"] == version - 1
        attributes = exchange["attributes"]
        assert attributes["kuberl.mode"] in ("p2p", "broadcast") and attributes["kuberl.replicas"] >= 1
    for step, span in steps_traced.items():
        assert {"wait_rollout", "train", "weight_push"} <= kinds[span["context"]["span_id"]]
        linked = {link["context"]["span_id"] for link in span["links"]}  # the step → the samples it trained
        assert linked == {s["context"]["span_id"] for s in trained if s["attributes"]["kuberl.step"] == step}
        assert span["attributes"]["kuberl.staleness"] == max(
            s["attributes"]["kuberl.staleness"] for s in trained if s["attributes"]["kuberl.step"] == step)
