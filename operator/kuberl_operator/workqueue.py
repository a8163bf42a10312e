"""The keys of the objects waiting for a sync, and the workers that sync them (client-go's workqueue).

An event handler only adds its object's key and returns: kopf's per-object worker ends at once and
lets the event's body go, instead of waiting — body, stack and all — for a turn to sync (with 1,000
experiments created at once, thousands of such waiters held most of the operator's memory). A key
waits at most once however many events ask for it (related events coalesce), and one key is never
synced by two workers at once: added while its sync runs, it goes to the back of the queue when that
sync ends (the sync then sees everything that happened meanwhile). ``workers`` syncs run at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from .retry import reraise_if_cancelled

K = TypeVar("K", bound=Hashable)
log = logging.getLogger("kuberl.operator")


class WorkQueue(Generic[K]):
    """FIFO of keys, each at most once; ``process`` runs for one key at a time per key. Its counters
    and sets change only through ``add`` and the workers."""

    def __init__(self, process: Callable[[K], Awaitable[None]]) -> None:
        self._process = process
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._waiting: set[K] = set()  # in the queue
        self._active: set[K] = set()  # being processed
        self._again: set[K] = set()  # added while being processed: queued again when that ends
        self._workers: list[asyncio.Task[None]] = []

    def add(self, key: K) -> None:
        """Ask for ``key`` to be processed (soon; once however often it is asked before its turn)."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._waiting:
            self._waiting.add(key)
            self._queue.put_nowait(key)

    def __len__(self) -> int:
        """Keys waiting for their turn."""
        return len(self._waiting)

    @property
    def started(self) -> bool:
        return bool(self._workers)

    def start(self, workers: int, name: str) -> None:
        """``workers`` tasks, each with a copy of the caller's context (contextvars)."""
        self._workers = [asyncio.get_running_loop().create_task(self._work(), name=f"{name}-{i}")
                         for i in range(workers)]

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._waiting.discard(key)
            self._active.add(key)
            try:
                await self._process(key)
            except Exception as err:  # ``process`` handles its own failures; a bug must not stop the worker
                reraise_if_cancelled(err)
                log.exception("sync of %s raised", key)
            finally:
                self._active.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self.add(key)
