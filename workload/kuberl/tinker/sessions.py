"""Who holds which session, and which have ended: the SDK opens one per ``ServiceClient``, sends a heartbeat
every 10 s and finishes it on ``close()``. A session not heard from for ``expiry_seconds`` has expired; an
ended session is remembered (the last 4096) so that its client is told it is gone rather than unknown.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable

from .errors import Gone, NotFound


class SessionTable:
    REMEMBERED = 4096

    def __init__(self, expiry_seconds: float, clock: Callable[[], float]):
        self.expiry_seconds, self.clock = expiry_seconds, clock
        self.owners: dict[str, str] = {}  # open session → its client
        self.last_heard: dict[str, float] = {}  # open session → its last heartbeat (or its start)
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()

    def open(self, owner: str) -> str:
        session_id = f"session-{uuid.uuid4().hex}"
        self.owners[session_id], self.last_heard[session_id] = owner, self.clock()
        return session_id

    def check(self, owner: str, session_id: str) -> None:
        if self.owners.get(session_id) != owner:
            if self.ended.get(session_id) == owner:
                raise Gone(f"session {session_id!r} has finished (closed, or no heartbeat for "
                           f"{self.expiry_seconds:.0f} s): its models and samplers are released")
            raise NotFound(f"session {session_id!r} is not one of yours")

    def heard(self, owner: str, session_id: str) -> None:
        self.check(owner, session_id)
        self.last_heard[session_id] = self.clock()

    def end(self, owner: str, session_id: str) -> None:
        self.check(owner, session_id)
        del self.owners[session_id], self.last_heard[session_id]
        self.ended[session_id] = owner
        while len(self.ended) > self.REMEMBERED:
            self.ended.popitem(last=False)

    def expired(self) -> list[tuple[str, str]]:
        """(client, session) of every open session not heard from for ``expiry_seconds``."""
        now = self.clock()
        return [(self.owners[s], s) for s, heard in self.last_heard.items() if now - heard > self.expiry_seconds]
