"""A test's stand-in servers on loopback, each on its own event loop thread."""

from __future__ import annotations

import threading
from typing import Any


def serve_in_thread(app: Any, port: int) -> Any:
    """``app`` on 127.0.0.1:``port`` on its own event loop thread (the inference pool's stand-in
    process); returns a function that stops it."""
    import asyncio

    from aiohttp import web

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner = web.AppRunner(app, shutdown_timeout=1.0)  # a stand-in: calls in flight are cancelled at stop

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    return lambda: asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
