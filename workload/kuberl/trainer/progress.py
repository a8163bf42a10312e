"""Trainer rank 0's progress endpoint (``GET /progress``, ``GET /metrics``), polled by the operator
and by ``kuberl run``; the workload never needs write access to the Kubernetes API."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

log = logging.getLogger("kuberl.trainer")


@dataclass
class Progress:
    step: int = 0
    first_step: int = 0  # where this process started (a resumed run): rates and ETAs count from here
    max_steps: int = 0
    version: int = 0
    reward: float | None = None
    reward_first10: float | None = None
    reward_last10: float | None = None
    max_staleness: int = 0
    tokens_per_second: float = 0.0
    step_seconds: float = 0.0
    weight_sync_seconds: float = 0.0  # the last exchange (it overlaps the next step)
    behav_logp_gap: float | None = None  # mean |log π_behav − log π_θ| at version lag 0 (trainer.loss)
    entropy: float | None = None  # the policy's mean token entropy in the last step (ppo_actor/entropy)
    phase: str = "starting"
    last_checkpoint: str | None = None
    eval_step: int | None = None  # the last held-out evaluation (spec.evaluation)
    eval_reward: float | None = None
    eval_pass_at_k: float | None = None
    rewards: list[float] = field(default_factory=list)


class ProgressServer:
    """Serves a ``Progress`` that the trainer thread updates under a lock."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        self._gauges = {name: Gauge(f"kuberl_trainer_{name}", name, registry=self.registry)
                        for name in ("step", "version", "reward", "max_staleness", "tokens_per_second",
                                     "step_seconds", "weight_sync_seconds", "behav_logp_gap", "entropy", "eval_reward",
                                 "eval_pass_at_k")}
        self._sources: list[tuple[str, Callable[[], Mapping[str, int | float]]]] = []
        self._counters: dict[str, Gauge] = {}

    def add_counters(self, prefix: str, read: Callable[[], Mapping[str, int | float]]) -> None:
        """Export ``read()``'s numbers as gauges ``kuberl_<prefix>_<name>`` on ``/metrics`` (``read``
        runs on the server's event loop at every scrape, e.g. the agent gateway's counts)."""
        self._sources.append((prefix, read))

    def update(self, **changes: object) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self.progress, key, value)

    def snapshot(self) -> dict[str, object]:
        """The ``/progress`` body (everything but the per-step reward list)."""
        with self.lock:
            return {k: v for k, v in asdict(self.progress).items() if k != "rewards"}

    def write_termination_message(self, path: Path) -> None:
        """Leave the final progress where the kubelet reads a container's termination message
        (``/dev/termination-log``): the operator records it after this process is gone."""
        try:
            path.write_text(json.dumps(self.snapshot())[:4096])
        except OSError as err:  # not in a pod (local mode, tests): nothing reads it anyway
            log.debug("no termination message written to %s: %s", path, err)

    async def start(self, port: int) -> web.AppRunner:
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
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, os.environ.get("POD_IP") or "0.0.0.0", port).start()  # read-only routes
        return runner

    def start_in(self, loop: asyncio.AbstractEventLoop, port: int) -> None:
        asyncio.run_coroutine_threadsafe(self.start(port), loop).result(30)
