"""Per-client refusal budgets: a client (one remote address: an agent pod) whose calls keep being
refused — a bug retried in a tight loop, a flood — gets 429 with ``Retry-After`` before its request
is even read, and only once that wait has passed (at most ``TARPIT_SECONDS``): a client that ignores
``Retry-After`` and calls again at once is slowed to one call per connection per wait, so a flood
costs the rollout's event loop a few calls a second instead of thousands.

A token bucket per client: each refused call (a 4xx other than the 429s this module sends) takes a
token; tokens come back at ``rate`` per second up to ``burst``. A client with no token left is refused
until one comes back. Calls that succeed cost nothing: a well-behaved agent is never limited here
(its pace is the staleness budget's). At most ``MAX_CLIENTS`` buckets are kept; full ones go first.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from .params import error

MAX_CLIENTS = 4096
TARPIT_SECONDS = 1.0  # the longest a limited call is held before its 429
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class RefusalBudget:
    rate: float = 5.0  # refusals per second a client may keep up
    burst: float = 20.0  # refusals in a row before it is limited
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # client → (tokens, as of)
    limited: int = 0  # calls answered 429 here

    def tokens(self, client: str) -> float:
        tokens, since = self._buckets.get(client, (self.burst, self.clock()))
        return min(self.burst, tokens + (self.clock() - since) * self.rate)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may call again; None when it may now."""
        tokens = self.tokens(client)
        return None if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def charge(self, client: str) -> None:
        """One refusal of ``client``."""
        self._buckets[client] = (self.tokens(client) - 1.0, self.clock())
        if len(self._buckets) > MAX_CLIENTS:
            for name in [c for c in self._buckets if self.tokens(c) >= self.burst][:len(self._buckets) // 2]:
                del self._buckets[name]

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        """aiohttp middleware (outermost: before authentication and the body)."""

        @web.middleware
        async def limit(request: web.Request, handler: Handler) -> web.StreamResponse:
            client = request.remote or ""
            if (wait := self.retry_after(client)) is not None:
                self.limited += 1
                await asyncio.sleep(min(wait, TARPIT_SECONDS))  # a sleeping call costs the loop nothing
                seconds = max(1, math.ceil(wait))
                return error(429, f"too many refused calls from this client; retry after {seconds} s",
                             "rate_limit_error", headers={"Retry-After": str(seconds),
                                                          "retry-after-ms": str(math.ceil(wait * 1000))})
            try:
                response = await handler(request)
            except web.HTTPException as refused:  # raised 4xx (a body too large, not JSON, …)
                if 400 <= refused.status < 500:
                    self.charge(client)
                raise
            if 400 <= response.status < 500 and response.status != 429:
                self.charge(client)
            return response

        return limit
