"""Traces of a sample's life (``spec.observability``): OpenTelemetry spans from admission through
generation and scoring to the step that trained it (``kuberl.tracing``)."""

from __future__ import annotations

from pydantic import Field

from .base import ApiModel
from .tracking import HTTP_URL


class ObservabilitySpec(ApiModel):
    """OpenTelemetry traces: sent by OTLP/HTTP to ``otlpEndpoint`` when it is set; ``kuberl run`` also
    writes them to ``<workdir>/traces.jsonl``. A sampled sample's trace: ``sample`` (admission to the
    step that trained it: its version, staleness, or why it was dropped) with a ``generate`` span per
    request to a replica (which replica, tokens, seconds) and a ``score`` span for its reward."""

    otlp_endpoint: str | None = Field(None, pattern=HTTP_URL, max_length=512,
                                      description="an OTLP/HTTP collector, e.g. http://otel-collector.observability:"
                                                  "4318 (spans go to /v1/traces); unset: no export from pods")
    trace_sample_rate: float = Field(0.05, gt=0, le=1, description="the share of samples traced (by trace id)")
