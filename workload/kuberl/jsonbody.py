"""JSON request bodies for the workload's aiohttp servers: size-capped, errors as 400/413."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

MAX_JSON_BYTES = 8 * 2**20  # a prompt at its caps is ~1 MiB of JSON


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message)


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, at most ``MAX_JSON_BYTES`` (413 beyond), else 400."""
    if (request.content_length or 0) > MAX_JSON_BYTES:
        raise web.HTTPRequestEntityTooLarge(MAX_JSON_BYTES, request.content_length or 0)
    raw = bytearray()
    while chunk := await request.content.read(2**16):  # chunked bodies have no Content-Length
        raw += chunk
        if len(raw) > MAX_JSON_BYTES:
            raise web.HTTPRequestEntityTooLarge(MAX_JSON_BYTES, len(raw))
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request("the body is not JSON (or is nested too deeply)") from err
