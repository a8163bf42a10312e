"""What a gateway request asks for, checked: every refusal is a ``RequestError`` naming the field
(a 400 in OpenAI's error format, ``error``); pure functions but for that response helper."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..api.contract import HEADER_GROUP, HEADER_SESSION

SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_REWARD = 1e6


class RequestError(ValueError):
    """A request the gateway refuses (400); the message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str, param: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status, headers=headers)


def requested_tokens(body: dict[str, Any]) -> int | None:
    """max_completion_tokens / max_tokens (None: as many as the session has left)."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise RequestError("max_tokens: must be a positive integer", "max_tokens")
    return asked


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's ``stop``: a string or up to 4 non-empty strings."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 64
                                                                 for s in stops):
        raise RequestError("stop: a string or a list of up to 4 non-empty strings (≤ 64 characters)", "stop")
    if body.get("n", 1) != 1:
        raise RequestError("n: one completion per call (each is a turn of one episode; start n sessions)",
                                "n")
    return stops


def session_headers(headers: Mapping[str, str]) -> tuple[str, str | None]:
    """(session id, group key or None) from ``X-KubeRL-Session`` / ``X-KubeRL-Group``."""
    session_id = headers.get(HEADER_SESSION, "")
    if not SESSION_ID.match(session_id):
        raise RequestError(f"header {HEADER_SESSION}: required, 1-128 of [A-Za-z0-9._:-] (one id per episode)",
                           HEADER_SESSION)
    key = headers.get(HEADER_GROUP)
    if key is not None and not SESSION_ID.match(key):
        raise RequestError(f"header {HEADER_GROUP}: 1-128 of [A-Za-z0-9._:-]", HEADER_GROUP)
    return session_id, key


def reward_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or abs(value) > MAX_REWARD:
        raise RequestError(f"reward: a finite number within ±{MAX_REWARD:g} is required", "reward")
    return float(value)
