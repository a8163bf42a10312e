"""A rank whose training steps stop (a hung collective, a peer that vanished without closing its
sockets) exits non-zero, so the gang restarts from the last checkpoint instead of holding its
devices forever.

``StepWatchdog(timeout).start()`` after set-up; ``beat()`` after every step; if ``timeout`` seconds
pass without a beat, ``on_expire`` runs (by default: log and ``os._exit(EXIT_CODE)``: no clean-up,
which could itself hang in the stuck collective). The collective backends' own timeouts are set to
the same value (``collective_timeout_env``) so NCCL/HCCL/gloo give up at about the same time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kuberl.trainer")
EXIT_CODE = 3


def collective_timeout_env(seconds: int) -> dict[str, str]:
    """Env the collective libraries read at initialisation: HCCL's op timeout (NCCL and gloo take
    the process group's ``timeout``; TORCH_NCCL_ASYNC_ERROR_HANDLING makes NCCL abort on it)."""
    return {"HCCL_EXEC_TIMEOUT": str(seconds), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _exit(seconds: float) -> None:
    log.error("no training step finished for %.0f s (a hung collective or a lost peer?): exiting with code %d so "
              "the gang restarts from the last checkpoint (spec.trainer.stepTimeoutSeconds)", seconds, EXIT_CODE)
    logging.shutdown()
    os._exit(EXIT_CODE)


class StepWatchdog:
    def __init__(self, timeout: float, on_expire: Callable[[float], None] = _exit, poll: float | None = None):
        self.timeout, self.on_expire = timeout, on_expire
        self._poll = poll if poll is not None else min(10.0, timeout / 4)
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kuberl-step-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        """A step finished."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                self.on_expire(idle)
                return
