"""Run the operator: ``python -m kuberl_operator`` or ``kuberl operator``."""

from __future__ import annotations

import asyncio
import logging

import kopf


def run_operator(namespace: list[str] | None = None, verbose: bool = False) -> int:
    """Run kopf with our handlers until interrupted; watch ``namespace`` or the whole cluster."""
    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kuberl").setLevel(logging.DEBUG if verbose else logging.INFO)
    asyncio.run(kopf.operator(
        clusterwide=not namespace,
        namespaces=namespace or [],
        standalone=True,
    ))
    return 0
