"""A client-side rate limit on the operator's API calls: a token bucket shared by every sync.

``qps`` tokens a second, at most ``burst`` saved up; a call takes one token and waits for it when
there is none. So over any window of ``t`` seconds the operator sends at most ``burst + qps × t``
requests, however many objects are syncing at once (controller-runtime's client has the same two
knobs). The chart sets them (``operator.apiQPS``, ``operator.apiBurst``: env ``KUBERL_API_QPS``,
``KUBERL_API_BURST``). Reserving a token is pure arithmetic on the clock; only the wait sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .settings import DEFAULT_BURST, DEFAULT_QPS


@dataclass
class RateLimit:
    qps: float = DEFAULT_QPS
    burst: int = DEFAULT_BURST
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    _tokens: float = field(init=False)
    _last: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not (self.qps > 0 and self.burst >= 1):
            raise ValueError(f"rate limit: qps must be > 0 and burst ≥ 1 (got {self.qps}, {self.burst})")
        self._tokens = float(self.burst)

    def _reserve(self) -> float:
        """Take a token (possibly one not yet earned); returns how long to wait until it is."""
        now = self.clock()
        if self._last is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1.0
        return max(0.0, -self._tokens / self.qps)

    async def acquire(self) -> float:
        """Wait for a token; returns the seconds waited."""
        wait = self._reserve()
        if wait > 0:
            await self.sleep(wait)
        return wait
