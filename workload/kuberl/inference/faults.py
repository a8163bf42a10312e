"""Injected faults, for chaos tests and benchmarks of whole runs (``benchmarks/chaos.py``,
``benchmarks/autoscale.py``). Off unless the replica's environment sets ``KUBERL_FAULT_INJECTION``
(``Settings.fault_injection``); the operator never sets it. Its value is a comma-separated list of:

- ``signals``: ``SIGUSR1`` makes the replica answer every ``/generate`` with HTTP 500 — a broken engine
  behind a live server, the case a liveness probe does not catch: ``/health`` and every other route go
  on as before — and ``SIGUSR2`` ends it. Only a process allowed to signal the replica can open the door.
- ``generate-slots=N`` and ``generate-seconds=S`` (both): a replica of fixed capacity — at most N
  ``/generate`` requests at once, each held for at least S seconds, so the replica serves at most
  N ÷ S requests a second whatever the host's CPUs: an accelerator whose engine is the bottleneck, the
  regime the pool autoscaler is for, on a host where every replica shares the same cores.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from ..api.contract import ENV_FAULT_INJECTION

log = logging.getLogger("kuberl.inference")
FAILING_PATHS = frozenset({"/generate"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InjectedFaults:
    """The faults of one replica: whether it fails its requests now (``failing``, switched by the two
    signals when ``plan.signals``) and its fixed capacity (``plan.generate_slots``)."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self.failing = False
        self._slots = asyncio.Semaphore(plan.generate_slots) if plan.generate_slots else None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.plan.signals:
            loop.add_signal_handler(signal.SIGUSR1, self._set, True)
            loop.add_signal_handler(signal.SIGUSR2, self._set, False)
            log.warning("fault injection is on: SIGUSR1 makes /generate answer 500, SIGUSR2 ends it")
        if self.plan.generate_slots:
            log.warning("fault injection is on: at most %d /generate at once, each held %.3f s at least",
                        self.plan.generate_slots, self.plan.generate_seconds)

    def _set(self, failing: bool) -> None:
        self.failing = failing
        log.warning("injected fault: /generate answers %s", "500" if failing else "normally again")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in FAILING_PATHS:
            return await handler(request)
        if self.failing:
            return web.Response(status=500, text="injected fault (KUBERL_FAULT_INJECTION)")
        if self._slots is None:
            return await handler(request)
        async with self._slots:
            started = time.monotonic()
            response = await handler(request)
            await asyncio.sleep(max(0.0, self.plan.generate_seconds - (time.monotonic() - started)))
            return response


@dataclass(frozen=True)
class FaultPlan:
    """``KUBERL_FAULT_INJECTION`` parsed (see the module docstring)."""

    signals: bool = False
    generate_slots: int | None = None
    generate_seconds: float = 0.0


def fault_plan(mode: str) -> FaultPlan:
    """Parse ``mode``; a ValueError names the variable and the allowed items."""
    allowed = "allowed: signals, generate-slots=N with generate-seconds=S (comma-separated), or unset"
    items: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in mode.split(","))):
        key, _, value = item.partition("=")
        if key not in ("signals", "generate-slots", "generate-seconds") or (key == "signals") == bool(value):
            raise ValueError(f"{ENV_FAULT_INJECTION}: {mode!r} is not a fault injection mode; {allowed}")
        items[key] = value
    try:
        slots = int(items["generate-slots"]) if "generate-slots" in items else None
        seconds = float(items.get("generate-seconds", "0"))
    except ValueError as err:
        raise ValueError(f"{ENV_FAULT_INJECTION}: {mode!r}: a number was expected ({err}); {allowed}") from err
    if ("generate-slots" in items) != ("generate-seconds" in items) or (slots is not None and slots < 1) \
            or not 0 <= seconds < 3600:
        raise ValueError(f"{ENV_FAULT_INJECTION}: {mode!r}: generate-slots ≥ 1 and generate-seconds in [0, 3600) "
                         f"go together; {allowed}")
    return FaultPlan(signals="signals" in items, generate_slots=slots, generate_seconds=seconds)


def injected_faults(mode: str) -> InjectedFaults | None:
    """The faults ``mode`` (``Settings.fault_injection``) asks for; None for "" (none)."""
    plan = fault_plan(mode)
    return InjectedFaults(plan) if plan != FaultPlan() else None
