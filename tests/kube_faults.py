"""Faults the emulated API server injects (``KubeEmulator.faults``): a status, a 410 on a watch, or no
answer at all, for the next requests that match."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp.web

FAULT_REASONS = {403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
                 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass
class Fault:
    """Fault injection: the next ``times`` requests matching ``method`` (GET, POST, PATCH, DELETE,
    LIST for collection reads, WATCH: a 410 comes as a real server sends it, an ERROR event),
    ``plural`` and, when given, ``namespace`` ("" = cluster-wide requests only) and ``subresource``
    get ``status`` as a metav1.Status (429 with Retry-After), or with ``status`` 0 no answer for
    ``hang`` seconds (the client's timeout fires)."""

    method: str
    plural: str
    status: int
    times: int = 1
    namespace: str | None = None
    subresource: str | None = None
    hang: float = 10.0
    hits: int = 0

    def matches(self, method: str, plural: str, namespace: str | None, subresource: str | None) -> bool:
        return (self.hits < self.times and self.method == method and self.plural == plural
                and (self.namespace is None or self.namespace == (namespace or ""))
                and (self.subresource is None or self.subresource == subresource))

    async def respond(self) -> aiohttp.web.Response:
        self.hits += 1
        if self.status == 0:
            await asyncio.sleep(self.hang)
            return aiohttp.web.json_response({}, status=504)
        reason = FAULT_REASONS.get(self.status, "Injected")
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"injected fault: {reason}", "reason": reason, "code": self.status}
        headers = {"Retry-After": "1"} if self.status == 429 else {}
        return aiohttp.web.json_response(body, status=self.status, headers=headers)
