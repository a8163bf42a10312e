"""OpenTelemetry tracing of a sample's life (``spec.observability``, ``kuberl.api.observability``).

``set_up`` installs the process's tracer provider once: spans sampled by trace id at
``traceSampleRate``, sent by OTLP/HTTP to ``otlpEndpoint`` and/or written to ``settings.trace_file``
(one span per JSON line, as the SDK renders a span). Instrumented code takes its tracer from
``opentelemetry.trace.get_tracer`` at import and never checks whether tracing is on: without a
provider every span is a no-op. Spans are exported from a background thread (a batch processor),
never on the caller's event loop; ``shut_down`` flushes them. The SDK is imported by ``set_up`` only when
there is somewhere to send spans (≈ 0.3 CPU-s a process otherwise spent on tracing that is off).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags, set_span_in_context

from .api.observability import ObservabilitySpec
from .settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

    from .api.progress import WeightPush

log = logging.getLogger("kuberl.tracing")
_provider: TracerProvider | None = None
_files: list[IO[str]] = []


def one_line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


def set_up(spec: ObservabilitySpec | None, settings: Settings, service: str) -> bool:
    """Trace this process (``service``: e.g. kuberl-rollout) as ``spec`` says; False when there is nowhere to
    send spans (no spec, or neither an endpoint nor a file)."""
    global _provider
    if spec is None or (spec.otlp_endpoint is None and settings.trace_file is None) or _provider is not None:
        return _provider is not None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(spec.trace_sample_rate)))
    if spec.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=spec.otlp_endpoint.rstrip("/") + "/v1/traces")))
    if settings.trace_file is not None:
        out = settings.trace_file.open("a", encoding="utf-8")
        _files.append(out)
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=out, formatter=one_line)))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing %g of samples to %s", spec.trace_sample_rate,
             " and ".join(str(x) for x in (spec.otlp_endpoint, settings.trace_file) if x is not None))
    return True


def shut_down() -> None:
    """Export what is buffered and close the trace file."""
    if _provider is not None:
        _provider.shutdown()
    for out in _files:
        out.close()
    _files.clear()


def link(span: Span, others: Iterable[tuple[int, int]]) -> None:
    """Link ``span`` to each of ``others`` (a sampled span's trace id and span id, in a trace of its own: a step to
    the samples it trains); nothing when ``span`` is not recorded."""
    if span.is_recording():
        for trace_id, span_id in others:
            span.add_link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)))


class ExchangeSpans:
    """Each weight exchange as a ``weight_exchange`` span under the ``weight_push`` span that started it, from
    its start to the moment its slowest replica served it — known only when the trainer waits for it, a step
    later (the exchange overlaps the next step): :meth:`started` keeps where and when, :meth:`ended` records
    the span from the exchange's account (mode, transport, bytes, GB/s, replicas, the slowest, the plan's
    busiest port); nothing for an exchange whose push was not traced."""

    def __init__(self) -> None:
        self._started: dict[int, tuple[SpanContext, int]] = {}
        self._tracer = trace.get_tracer("kuberl.trainer")

    def started(self, version: int, start_ns: int) -> None:
        """Version ``version`` is being pushed from the current span (``weight_push``), since ``start_ns``."""
        context = trace.get_current_span().get_span_context()
        if context.is_valid and context.trace_flags.sampled:
            self._started[version] = (context, start_ns)

    def ended(self, push: WeightPush | None) -> None:
        """The account of an exchange that has ended."""
        if push is None or (begun := self._started.pop(push.version, None)) is None:
            return
        context, start_ns = begun
        attributes = {f"kuberl.{key}": value for key, value in push.model_dump(exclude_none=True).items()
                      if isinstance(value, int | float | str | bool)}
        span = self._tracer.start_span("weight_exchange", context=set_span_in_context(NonRecordingSpan(context)),
                                       start_time=start_ns, attributes=attributes)
        span.end(end_time=start_ns + round(push.seconds * 1e9))
