"""Run the operator: ``python -m kuberl_operator`` or ``kuberl operator``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator
from types import ModuleType

from kuberl.interpreter import freeze_set_up_heap


@contextlib.contextmanager
def not_importable(package: str) -> Iterator[None]:
    """``import package`` raises ImportError inside, and works again after (unless it was imported)."""
    if package in sys.modules:
        yield
        return
    sys.modules[package] = None  # type: ignore[assignment]  # Python's own "import fails" marker
    try:
        yield
    finally:
        if package in sys.modules and sys.modules[package] is None:
            del sys.modules[package]


def import_handlers() -> ModuleType:
    """Import kopf and register the handlers without the ``kubernetes`` client: kopf imports it when it
    is installed, to recognise its model objects and to offer its log-in (neither used here) — 47 MiB
    of the idle operator's 103. It is installed for the Kubeflow SDK, which a kubeflow or trainjob
    runtime's builder imports when it builds one (then it loads)."""
    with not_importable("kubernetes"):
        import kopf  # noqa: F401  # first, while the client cannot load

        from . import handlers  # registers the handlers
    return handlers


GC_YOUNG_OBJECTS = 10_000  # allocations between collections of the youngest generation (Python's default: 700)


def tune_garbage_collection() -> None:
    """Fewer, cheaper cyclic collections: when kopf watched, each event's body was freed only by the
    cyclic collector, which at Python's default thresholds took a third of the operator's CPU for
    1,000 experiments (``benchmarks/operator_scale.py``); the informers' bodies are plain JSON, but
    the syncs still allocate in bursts. What the imports built (modules, pydantic schemas) lives as
    long as the process: frozen (:func:`kuberl.interpreter.freeze_set_up_heap`), the collector never traverses
    it again."""
    freeze_set_up_heap()
    gc.set_threshold(GC_YOUNG_OBJECTS, 10, 10)


def run_operator(namespace: list[str] | None = None, verbose: bool = False, liveness: str | None = None) -> int:
    """Run kopf with our handlers until interrupted; watch ``namespace`` or the whole cluster.

    ``liveness``: e.g. ``http://0.0.0.0:8080/healthz``, kopf's health endpoint for the pod's probes.
    """
    handlers = import_handlers()
    import kopf

    tune_garbage_collection()

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kuberl").setLevel(logging.DEBUG if verbose else logging.INFO)
    asyncio.run(kopf.operator(standalone=True, liveness_endpoint=liveness, **handlers.operator_scope(namespace)))
    return 0
