"""What a client is told when a request cannot be served, each with the HTTP status the server answers."""

from __future__ import annotations


class ClientError(ValueError):
    """The request names something that is not there or not served; the message says which field and why.
    Sent back as HTTP 400 (or a future's failure with category "user")."""


class NotFound(KeyError):
    """No such model, sampler, session or future for this client — another client's reads the same (404)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Gone(KeyError):
    """The session has finished (closed, or expired without heartbeats): 410, on which the SDK stops its
    heartbeats."""

    def __str__(self) -> str:
        return str(self.args[0])


class Busy(RuntimeError):
    """The client has as much work waiting, or has used as many tokens, as it may: retry after ``retry_after``
    seconds (429 with Retry-After; the SDK retries)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after
