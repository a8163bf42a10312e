"""Reconcile errors are never silent: each failed sync is retried per object with exponential
backoff, and an error that will not heal by itself (a 4xx other than 409/429, or a bug) also
becomes a ``Degraded`` condition and a Kubernetes Event naming the object and the reason — as does
a transient one (5xx, 429, no answer) that has not healed after ``PERSISTENT_ATTEMPTS`` tries in a
row (``persistent``: about a minute with the default backoff; a webhook that always fails, a quota
that always answers 429).

Pure parts here (classification, delays, the per-object attempt counters); the handlers run the
syncs and schedule the retries.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from random import Random

import aiohttp

from .kube import ApiError

TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})  # plus every 5xx
PERSISTENT_ATTEMPTS = 6  # a transient failure this many syncs in a row is reported (1+2+…+32 s ≈ 1 min)
MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Failure:
    """What a failed sync tells the user: ``reason`` (CamelCase, for conditions and Events) and a
    one-line ``message``; ``transient`` errors heal by themselves and are only retried."""

    transient: bool
    reason: str
    message: str
    retry_after: float | None = None


def _api_message(err: ApiError) -> str:
    try:
        body = json.loads(err.body or "")
    except (ValueError, TypeError):
        body = None
    text = body.get("message") if isinstance(body, dict) else None
    return str(text or err.reason or "no message")


def reraise_if_cancelled(err: BaseException) -> None:
    """Raise CancelledError if the running task was asked to stop while ``err`` happened: aiohttp may
    turn a cancellation into a connection error (its session closed under it at shutdown), and a loop
    that logs and goes on would then never stop (kopf waits for every task at exit)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from err


def classify(err: BaseException) -> Failure:
    """An exception of a sync → a Failure. API errors keep their status and the server's message;
    timeouts and connection errors are transient; anything else is a bug (not transient)."""
    if isinstance(err, ApiError):
        status = err.status
        transient = status in TRANSIENT_STATUSES or status >= 500 or status == 0
        retry_after = None
        header = err.headers.get("Retry-After")
        if header and str(header).isdigit():
            retry_after = float(header)
        message = f"the API server answered {status}: {_api_message(err)}"
        return Failure(transient, f"ApiError{status}", message[:MESSAGE_CHARS], retry_after)
    if isinstance(err, aiohttp.ClientError | TimeoutError | ConnectionError):
        return Failure(True, "ApiUnreachable", f"the API server did not answer: {err}"[:MESSAGE_CHARS])
    return Failure(False, "InternalError", f"{type(err).__name__}: {err}"[:MESSAGE_CHARS])


def reported(failure: Failure, attempt: int) -> Failure | None:
    """What to put on the object after failed attempt ``attempt``: a lasting failure at once, a
    transient one (other than a lost write race, 409) once it has persisted ``PERSISTENT_ATTEMPTS``
    times, its message saying so; None: only retry."""
    if not failure.transient:
        return failure
    if attempt < PERSISTENT_ATTEMPTS or failure.reason == "ApiError409":
        return None
    return Failure(True, failure.reason, f"{attempt} attempts in a row: {failure.message}"[:MESSAGE_CHARS],
                   failure.retry_after)


def backoff_seconds(attempt: int, retry_after: float | None = None, base: float = 1.0, cap: float = 300.0,
                    jitter: float = 1.0) -> float:
    """Delay before retry number ``attempt`` (1, 2, ...): d · (1 + jitter) / 2 with
    d = min(cap, base · 2^(attempt − 1)) and ``jitter`` drawn from [0, 1) ("equal jitter": between
    d/2 and d, so objects that failed together do not all retry together), and never sooner than
    the server's Retry-After."""
    delay = min(cap, base * 2 ** min(attempt - 1, 32)) * (1.0 + jitter) / 2
    return max(delay, retry_after or 0.0)


@dataclass
class Backoff:
    """Consecutive failures per object; changed only through ``failed`` and ``succeeded``."""

    base: float = 1.0
    cap: float = 300.0
    random: Random = field(default_factory=Random)
    _attempts: dict[tuple[str, ...], int] = field(default_factory=dict)

    def failed(self, key: tuple[str, ...], retry_after: float | None = None) -> tuple[int, float]:
        """Count a failure; returns (attempt number, seconds until the retry)."""
        self._attempts[key] = self._attempts.get(key, 0) + 1
        attempt = self._attempts[key]
        return attempt, backoff_seconds(attempt, retry_after, self.base, self.cap, self.random.random())

    def succeeded(self, key: tuple[str, ...]) -> bool:
        """Forget ``key``'s failures; True if it had any (it just recovered)."""
        return self._attempts.pop(key, 0) > 0
