"""Scoring off the rollout's event loop: a bounded pool of reward worker processes with a time limit
per call (``spec.reward.workers``, ``spec.reward.timeoutSeconds``).

A reward that raises, returns something other than a finite number, or runs past its limit scores 0
and is counted (``errors``, ``timeouts``: progress, status and the summary show both); a worker past
its limit is killed and replaced in the background, so one hung call costs at most the limit and
stalls nothing else. Processes rather than threads: a thread cannot be stopped, and ``math-verify``'s
own time limits need a main thread (each worker's is). KubeRL's cheap string rewards
(``kuberl.rewards.INLINE``) are scored in place: a round trip would cost more than the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from typing import Any, Protocol

from opentelemetry import trace

from ..api.contract import KUBERL_SECRET_ENV
from ..settings import environment_without
from . import INLINE, RewardFn, call_reward, load_reward

log = logging.getLogger("kuberl.rewards")
START_SECONDS = 120.0  # a worker's import of the reward module
LOGGED_ERRORS = 5  # the first failures are logged with their message; later ones only counted


class Scorer(Protocol):
    timeouts: int
    errors: int
    concurrent: bool  # scores gain from being awaited together (workers); False: each runs to its end at once

    async def score(self, prompt: str, completion: str, answer: str, row: dict[str, Any]) -> float: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


class _Counted:
    timeouts = 0
    errors = 0

    def _failed(self, what: str) -> float:
        self.errors += 1
        if self.errors <= LOGGED_ERRORS:
            log.warning("reward failed, scored 0 (%d so far): %s", self.errors, what)
        return 0.0


class InlineScorer(_Counted):
    """``fn`` called on the event loop itself: only for rewards that cannot block (``INLINE``)."""

    concurrent = False

    def __init__(self, fn: RewardFn):
        self.fn = fn

    async def score(self, prompt: str, completion: str, answer: str, row: dict[str, Any]) -> float:
        try:
            return call_reward(self.fn, prompt, completion, answer, row)
        except Exception as err:  # the reward's own failure: counted and scored 0, as in the pool
            return self._failed(f"{type(err).__name__}: {err}")

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class RewardPool(_Counted):
    """``workers`` processes serving ``function``; started on first use, on the caller's event loop."""

    concurrent = True

    def __init__(self, function: str, workers: int, timeout: float):
        self.function, self.workers, self.timeout = function, workers, timeout
        self._idle: asyncio.Queue[asyncio.subprocess.Process] | None = None
        self._all: set[asyncio.subprocess.Process] = set()
        self._tasks: set[asyncio.Task[Any]] = set()  # spawning and reaping workers
        self._closed = False

    async def score(self, prompt: str, completion: str, answer: str, row: dict[str, Any]) -> float:
        """The reward from an idle worker; the caller's span (``score``) learns which worker and how long the
        call waited for one."""
        idle, asked = self._started(), time.monotonic()
        worker = await idle.get()
        trace.get_current_span().set_attributes({"kuberl.reward_worker": worker.pid or 0,
                                                 "kuberl.reward_wait_seconds": round(time.monotonic() - asked, 6)})
        request = json.dumps({"prompt": prompt, "completion": completion, "answer": answer, "row": row},
                             default=str) + "\n"
        try:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(request.encode())
            await worker.stdin.drain()
            line = await asyncio.wait_for(worker.stdout.readline(), self.timeout)
        except TimeoutError:
            self.timeouts += 1
            log.warning("reward call past its %.0f s limit, scored 0 (%d so far); its worker is replaced",
                        self.timeout, self.timeouts)
            self._replace(worker)
            return 0.0
        except (ConnectionError, asyncio.CancelledError) as err:
            self._replace(worker)
            if isinstance(err, asyncio.CancelledError):
                raise
            return self._failed(f"worker gone ({err})")
        if not line:
            self._replace(worker)
            return self._failed(f"worker exited (code {await worker.wait()})")
        reply = parsed_reply(line)
        if reply is None:  # its replies' channel holds something else: what comes next cannot be trusted
            self._replace(worker)
            return self._failed(f"a malformed reply from the worker: {line[:200]!r}")
        idle.put_nowait(worker)
        return reply if isinstance(reply, float) else self._failed(reply)

    def close(self) -> None:
        """Kill every worker (from any thread; :meth:`aclose` on the pool's loop also reaps them)."""
        self._closed = True
        for worker in list(self._all):
            if worker.returncode is None:
                worker.kill()

    async def aclose(self) -> None:
        self.close()
        await asyncio.gather(*(worker.wait() for worker in list(self._all)))

    def _started(self) -> asyncio.Queue[asyncio.subprocess.Process]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.workers):
                self._spawn_soon()
        return self._idle

    def _replace(self, worker: asyncio.subprocess.Process) -> None:
        self._kill(worker)
        self._spawn_soon()

    def _kill(self, worker: asyncio.subprocess.Process) -> None:
        """Kill ``worker`` and reap it in the background (its exit status is of no interest)."""
        if worker.returncode is None:
            worker.kill()
        self._all.discard(worker)
        reaper = asyncio.get_running_loop().create_task(worker.wait())
        self._tasks.add(reaper)  # the loop holds tasks weakly
        reaper.add_done_callback(self._tasks.discard)

    def _spawn_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._spawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or log.error("reward worker could not start: %s", t.exception()))

    async def _spawn(self) -> None:
        """One worker into the idle queue once it has imported the reward; retried with back-off."""
        delay = 1.0
        while not self._closed:
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kuberl.rewards.worker", self.function, json.dumps(sys.path),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=environment_without(KUBERL_SECRET_ENV))  # a reward needs neither the pool's token nor the key
            self._all.add(worker)
            assert worker.stdout is not None
            try:
                line = await asyncio.wait_for(worker.stdout.readline(), START_SECONDS)
            except TimeoutError:
                line = b'{"error": "no answer within the start-up limit"}'
            reply = json.loads(line) if line else {"error": f"exit code {await worker.wait()}"}
            if reply.get("ready"):
                assert self._idle is not None
                self._idle.put_nowait(worker)
                return
            self._kill(worker)
            if self._closed:
                return
            log.error("reward worker for %s did not start (%s); retrying in %.0f s",
                      self.function, reply.get("error"), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


def parsed_reply(line: bytes) -> float | str | None:
    """A worker's reply line: its reward (a finite number), its error message, or None when the line is
    neither (not JSON, not an object, a reward that is not a finite number)."""
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    if not isinstance(reply, dict):
        return None
    value = reply.get("reward")
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return str(reply["error"])[:500] if "error" in reply and "reward" not in reply else None


def make_scorer(function: str, workers: int, timeout: float, field: str = "spec.reward.function") -> Scorer:
    """The scorer for ``function``: imported here first, so that a missing one fails the start, naming
    ``field``; in place for ``INLINE`` rewards, else a :class:`RewardPool`."""
    fn = load_reward(function, field)
    return InlineScorer(fn) if fn in INLINE else RewardPool(function, workers, timeout)
