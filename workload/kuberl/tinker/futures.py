"""Long work as the Tinker API's futures: a request returns a request id at once; the client polls
``retrieve_future`` until the result is there.

A poll waits up to ``poll_seconds`` for the work to finish before it answers "try again" (so a client
polls a few times a minute, not in a busy loop). A finished result is kept for ``keep`` more results
(it may be fetched again after a lost connection), then dropped oldest first. A future belongs to one
client: another client's poll sees "unknown request", as for an id that never existed.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from dataclasses import dataclass, field
from typing import Any

USER, SERVER = "user", "server"  # RequestFailedResponse.category


@dataclass
class Outcome:
    """A finished request: a JSON body, protocol-buffer bytes, or a failure (message, category)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = USER


@dataclass
class _Entry:
    owner: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None


class FutureTable:
    def __init__(self, poll_seconds: float = 20.0, keep: int = 4096):
        self.poll_seconds, self.keep = poll_seconds, keep
        self._entries: dict[str, _Entry] = {}
        self._finished: collections.deque[str] = collections.deque()

    def open(self, owner: str) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        self._entries[request_id] = _Entry(owner)
        return request_id

    def finish(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries[request_id]
        entry.outcome = outcome
        entry.done.set()
        self._finished.append(request_id)
        while len(self._finished) > self.keep:
            self._entries.pop(self._finished.popleft(), None)

    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.outcome is None)

    async def retrieve(self, request_id: str, owner: str) -> Outcome | None:
        """The outcome, or None when it is not ready within the poll; KeyError when the id is not the owner's."""
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            raise KeyError(request_id)
        try:
            await asyncio.wait_for(entry.done.wait(), self.poll_seconds)
        except TimeoutError:
            return None
        return entry.outcome
