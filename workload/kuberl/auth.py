"""The experiment's API token on both sides of the workload's HTTP endpoints.

The operator creates one token per experiment (a Secret it owns) and gives it to every pod as
``KUBERL_API_TOKEN``; ``kuberl run`` makes one per run. Servers require ``Authorization: Bearer
<token>`` on every route but the read-only ones they name (health, metrics, version, ...);
clients send it on every request. The token is never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

from .api.contract import AUTH_HEADER, AUTH_SCHEME, ENV_API_TOKEN

MIN_TOKEN_CHARS = 16


class MissingToken(RuntimeError):
    pass


def checked_token(token: str, name: str = ENV_API_TOKEN) -> str:
    """``token`` as the process got it from ``name`` (``KUBERL_API_TOKEN``; the gateway's:
    ``KUBERL_AGENT_TOKEN``); refuses to go on without one (or with a short one)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise MissingToken(f"{name} is unset or shorter than {MIN_TOKEN_CHARS} characters: the servers "
                           "refuse to run without the experiment's token (the operator sets it from the "
                           "experiment's Secret; kuberl run makes one)")
    return token


def bearer(token: str) -> dict[str, str]:
    """The request header that carries ``token``."""
    return {AUTH_HEADER: f"{AUTH_SCHEME} {token}"}


def authorized(header: str | None, token: str) -> bool:
    """``header`` is ``Bearer <token>`` (compared in constant time). A header that is not text (bytes
    that are not UTF-8 reach aiohttp's handlers as lone surrogates) is simply not the token."""
    scheme, _, presented = (header or "").partition(" ")
    try:
        presented_bytes = presented.encode()
    except UnicodeEncodeError:
        return False
    return scheme == AUTH_SCHEME and hmac.compare_digest(presented_bytes, token.encode())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def require_token(token: str, open_paths: Collection[str]) -> Middleware:
    """aiohttp middleware: 401 for a request to any path outside ``open_paths`` without the token."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in open_paths and not authorized(request.headers.get(AUTH_HEADER), token):
            raise web.HTTPUnauthorized(text="this endpoint needs the experiment's API token "
                                            f"({AUTH_HEADER}: {AUTH_SCHEME} <token>)",
                                       headers={"WWW-Authenticate": AUTH_SCHEME})
        return await handler(request)

    return check
