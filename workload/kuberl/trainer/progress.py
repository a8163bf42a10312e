"""Trainer rank 0's progress endpoint (``GET /progress``, ``GET /metrics``), polled by the operator
and by ``kuberl run``; the workload never needs write access to the Kubernetes API."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from ..api.progress import Progress

log = logging.getLogger("kuberl.trainer")
TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet keeps of a container's termination message
DROPPED_FIRST = ("lastPush", "initFrom", "lastExport", "modelRevision", "lastCheckpoint")  # the longest, least needed
GAUGES = ("step", "version", "reward", "observed_staleness", "late_groups_trained", "tokens_per_second", "step_seconds",
          "weight_sync_seconds", "behav_logp_gap", "entropy", "eval_reward", "eval_pass_at_k", "eval_version_span",
          "rollout_wait_fraction", "rollout_cpu_fraction", "rollout_ready_groups", "staleness_budget_used",
          "pushes_fell_back", "pushes_slow_replica")


class ProgressServer:
    """Serves a ``Progress`` (``kuberl.api.progress``, camelCase) that the trainer thread updates under
    a lock; its numbers are also gauges ``kuberl_trainer_<field>`` on ``/metrics``."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        self._gauges = {name: Gauge(f"kuberl_trainer_{name}", field.description or name, registry=self.registry)
                        for name, field in Progress.model_fields.items() if name in GAUGES}
        self._sources: list[tuple[str, Callable[[], Mapping[str, int | float]]]] = []
        self._counters: dict[str, Gauge] = {}
        self._served: tuple[asyncio.AbstractEventLoop, web.AppRunner] | None = None

    def add_counters(self, prefix: str, read: Callable[[], Mapping[str, int | float]]) -> None:
        """Export ``read()``'s numbers as gauges ``kuberl_<prefix>_<name>`` on ``/metrics`` (``read``
        runs on the server's event loop at every scrape, e.g. the agent gateway's counts)."""
        self._sources.append((prefix, read))

    def update(self, **changes: object) -> None:
        """Apply ``changes`` (``Progress`` field names; see ``Progress.merged``)."""
        with self.lock:
            self.progress = self.progress.merged(**changes)

    def snapshot(self) -> dict[str, object]:
        """The ``/progress`` body: the wire form of ``Progress``."""
        with self.lock:
            return self.progress.to_wire()

    def write_termination_message(self, path: Path) -> None:
        """Leave the final progress where the kubelet reads a container's termination message
        (``/dev/termination-log``): the operator records it after this process is gone."""
        try:
            path.write_text(termination_message(self.snapshot()))
        except OSError as err:  # not in a pod (local mode, tests): nothing reads it anyway
            log.debug("no termination message written to %s: %s", path, err)

    async def start(self, port: int, host: str = "") -> web.AppRunner:
        """Serve on ``host`` (the pod's IP; "": every address) and ``port``."""
        async def progress(request: web.Request) -> web.Response:
            return web.json_response(self.snapshot())

        async def metrics(request: web.Request) -> web.Response:
            with self.lock:
                for name, gauge in self._gauges.items():
                    value = getattr(self.progress, name)
                    gauge.set(value if value is not None else float("nan"))
            for prefix, read in self._sources:
                for name, value in read().items():
                    key = f"kuberl_{prefix}_{name}"
                    if key not in self._counters:
                        self._counters[key] = Gauge(key, f"{prefix} {name}", registry=self.registry)
                    self._counters[key].set(value)
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/progress", progress)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)  # polled every few seconds: no line per poll
        await runner.setup()
        await web.TCPSite(runner, host or "0.0.0.0", port).start()  # read-only routes
        return runner

    def start_in(self, loop: asyncio.AbstractEventLoop, port: int, host: str = "") -> None:
        asyncio.run_coroutine_threadsafe(self.start(port, host), loop).result(30)

    def serve_in_thread(self, port: int, host: str = "") -> None:
        """Serve from an event loop on a thread of its own (:meth:`close` ends it)."""
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="progress", daemon=True).start()
        self._served = loop, asyncio.run_coroutine_threadsafe(self.start(port, host), loop).result(30)

    def close(self) -> None:
        """Stop serving (what :meth:`serve_in_thread` started): the port closes, the thread ends."""
        if self._served is not None:
            loop, runner = self._served
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            self._served = None


def termination_message(progress: dict[str, object]) -> str:
    """``progress`` as JSON within :data:`TERMINATION_MESSAGE_BYTES` (cut, it would be no JSON at all): the
    fields of :data:`DROPPED_FIRST` left out, in that order, until it fits; past them, only its numbers."""
    kept = dict(progress)
    for key in DROPPED_FIRST:
        if len(json.dumps(kept).encode()) <= TERMINATION_MESSAGE_BYTES:
            break
        kept.pop(key, None)
    text = json.dumps(kept)
    if len(text.encode()) <= TERMINATION_MESSAGE_BYTES:
        return text
    return json.dumps({k: v for k, v in kept.items() if isinstance(v, int | float)})
