"""Run the operator: ``python -m kuberl_operator`` or ``kuberl operator``."""

from __future__ import annotations

import asyncio
import gc
import logging

import kopf

GC_YOUNG_OBJECTS = 10_000  # allocations between collections of the youngest generation (Python's default: 700)


def tune_garbage_collection() -> None:
    """Fewer, cheaper cyclic collections. kopf wraps every watch event's body in views that refer to
    each other (a reference cycle), so each event's parsed body is freed only by the cyclic collector;
    at Python's default thresholds it ran ~3,600 times and took a third of the operator's CPU for
    1,000 experiments (``benchmarks/operator_scale.py``). What the imports built (modules, pydantic
    schemas) lives as long as the process: frozen, the collector never traverses it again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, 10, 10)


def run_operator(namespace: list[str] | None = None, verbose: bool = False, liveness: str | None = None) -> int:
    """Run kopf with our handlers until interrupted; watch ``namespace`` or the whole cluster.

    ``liveness``: e.g. ``http://0.0.0.0:8080/healthz``, kopf's health endpoint for the pod's probes.
    """
    from . import handlers  # registers the handlers

    tune_garbage_collection()

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kuberl").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:  # kopf says "Handler … succeeded" at INFO for every event of every object
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(kopf.operator(standalone=True, liveness_endpoint=liveness, **handlers.operator_scope(namespace)))
    return 0
