"""The one error a client causes: a request this server cannot act on, with a message naming the field."""

from __future__ import annotations


class ClientError(ValueError):
    """The request names something that is not there or not served; the message says which field and why.
    Sent back as HTTP 400 (or a future's failure with category "user")."""
