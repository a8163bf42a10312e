"""Run the operator: ``python -m kuberl_operator`` or ``kuberl operator``."""

from __future__ import annotations

import asyncio
import logging

import kopf


def run_operator(namespace: list[str] | None = None, verbose: bool = False, liveness: str | None = None) -> int:
    """Run kopf with our handlers until interrupted; watch ``namespace`` or the whole cluster.

    ``liveness``: e.g. ``http://0.0.0.0:8080/healthz``, kopf's health endpoint for the pod's probes.
    """
    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kuberl").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:  # kopf says "Handler … succeeded" at INFO for every event of every object
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(kopf.operator(
        clusterwide=not namespace,
        namespaces=namespace or [],
        standalone=True,
        liveness_endpoint=liveness,
    ))
    return 0
