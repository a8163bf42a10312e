"""Injected faults, for chaos tests of whole runs (``benchmarks/chaos.py``). Off unless the replica's
environment sets ``KUBERL_FAULT_INJECTION=signals`` (``Settings.fault_injection``); the operator never
sets it.

On, ``SIGUSR1`` makes the replica answer every ``/generate`` with HTTP 500 — a broken engine behind a
live server, the case a liveness probe does not catch: ``/health`` and every other route go on as
before — and ``SIGUSR2`` ends it. Only a process allowed to signal the replica can open the door.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..api.contract import ENV_FAULT_INJECTION

log = logging.getLogger("kuberl.inference")
FAILING_PATHS = frozenset({"/generate"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InjectedFaults:
    """Whether this replica fails its requests now (``failing``), switched by the two signals."""

    def __init__(self) -> None:
        self.failing = False

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGUSR1, self._set, True)
        loop.add_signal_handler(signal.SIGUSR2, self._set, False)
        log.warning("fault injection is on: SIGUSR1 makes /generate answer 500, SIGUSR2 ends it")

    def _set(self, failing: bool) -> None:
        self.failing = failing
        log.warning("injected fault: /generate answers %s", "500" if failing else "normally again")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.failing and request.path in FAILING_PATHS:
            return web.Response(status=500, text="injected fault (KUBERL_FAULT_INJECTION)")
        return await handler(request)


def injected_faults(mode: str) -> InjectedFaults | None:
    """The fault door ``mode`` (``Settings.fault_injection``) asks for: "" none, "signals" the above."""
    if mode not in ("", "signals"):
        raise ValueError(f"{ENV_FAULT_INJECTION}: {mode!r} is not a fault injection mode; allowed: signals (or unset)")
    return InjectedFaults() if mode else None
