"""Asynchronous rollout on its own event loop (a background thread of trainer rank 0's rollout process,
``kuberl.trainer.rollout_process``, whose requests from the trainer run on other threads).

The loop keeps as many episodes running as admission allows (``StalenessManager``, counted in
groups), puts finished groups in the ``RolloutBuffer`` and hands batches to the trainer thread.
Episodes come from the dataset through the run's workflow, each prompt handed out and accounted for
by the ``PromptLedger`` (trained exactly once: a failed group — or with ``lateGroups: drop`` a late one —
gives its prompt back), or
(``prompts=None``) from outside: the agent gateway (``kuberl.gateway``) runs on this loop and uses
``admit`` / ``deliver``.
Generation never waits for training unless admission would let staleness exceed η; with η = 0 it is
synchronous RL. Weight updates are pushed to every replica while generation goes on; then the
version bumps and admission reopens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span

from ..api.progress import PoolReceipt
from ..data.datasets import Example
from .buffer import RolloutBuffer
from .client import InferenceClient, tracer
from .evaluation import EvalResult, evaluate
from .ledger import PromptLedger
from .lengths import EpisodeLengths
from .staleness import StalenessManager
from .types import Group, version_lag
from .workflow import RolloutWorkflow

log = logging.getLogger("kuberl.rollout")
EVAL_VERSION_WAIT_SECONDS = 120.0  # an evaluation waits this long at most for the version it is due at
R = TypeVar("R")


class RolloutController:
    def __init__(self, client: InferenceClient, workflow: RolloutWorkflow | None, prompts: PromptLedger | None,
                 manager: StalenessManager, drop_stale: bool = False):
        """``drop_stale``: a group staler than η when trained is dropped and its prompt re-issued, instead of
        trained with its importance weights (``RolloutBuffer``; ``spec.rollout.lateGroups``)."""
        self.client, self.workflow, self.prompts, self.manager = client, workflow, prompts, manager
        self.buffer: RolloutBuffer[Group] = RolloutBuffer(manager, drop_stale, on_drop=self._give_back)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rollout", daemon=True)
        self._changed: asyncio.Condition | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._room = asyncio.Event()  # set (and replaced) by ``_fill``: ``room``'s callers wake up
        self._served = asyncio.Event()  # set (and replaced) when the replicas serve a new version
        self._error: BaseException | None = None
        self.episodes = 0
        self.generated_tokens = 0
        self.observed_staleness = 0
        self.lengths = EpisodeLengths()  # of the episodes generated, trained and dropped as too stale
        self._ahead: tuple[tuple[int, int], Future[list[Group] | None]] | None = None  # (groups, version): ``take``
        self._spans: dict[int, Span] = {}  # id(group) → its sampled ``sample`` span, until trained or dropped

    # -- called from the trainer thread ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self.call(self._started())

    def call(self, coro: Coroutine[Any, Any, R], timeout: float | None = None) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def prompt_state(self) -> dict[str, Any] | None:
        """The prompt ledger's state as of now (``PromptLedger.state``; None: episodes come from outside)."""
        return self.call(self._prompt_state())

    def prompt_counts(self) -> dict[str, int]:
        """The ledger's trained / reissued / skipped counts for progress reports, read from this thread
        without a round trip through the busy loop (1–4 ms): a snapshot of three ints, not a transaction
        (use :meth:`prompt_state` for a checkpoint). Empty when episodes come from outside."""
        ledger = self.prompts
        if ledger is None:
            return {}
        return {"trained": ledger.trained, "reissued": ledger.reissued, "skipped": ledger.skipped}

    def take(self, groups: int, version: int, ahead: bool = False) -> list[Group] | None:
        """Block until ``groups`` groups fresh enough for ``version`` are ready; None when the pool is
        starved (every replica needs weights only the trainer can send). Their prompts count as trained
        from here on. ``ahead``: start taking version + 1's batch now, on the rollout loop, so that the
        next ``take`` finds it ready instead of waiting for the loop to answer while it handles
        replies (1–4 ms a step measured). A batch taken ahead stays *pending* in the prompt ledger
        until a ``take`` hands it over (a checkpoint in between re-issues its prompts on resume); one
        taken for another version than the next ``take`` asks for goes back to the buffer."""
        ahead_of_time, self._ahead = self._ahead, None
        if ahead_of_time is not None and ahead_of_time[0] == (groups, version):
            batch = ahead_of_time[1].result()
        else:
            if ahead_of_time is not None and not ahead_of_time[1].cancel():  # it took a batch: back it goes
                self.call(self._put_back(ahead_of_time[1].result()))
            batch = self.call(self._take(groups, version))
        if batch is not None:
            answer, start = self._take_ahead(groups, version + 1) if ahead else (None, None)
            self.loop.call_soon_threadsafe(self._handed_over, batch, version, start)  # one wake-up of the loop
            if answer is not None:
                self._ahead = (groups, version + 1), answer
        return batch

    def _take_ahead(self, groups: int, version: int) -> tuple[Future[list[Group] | None], Callable[[], None]]:
        """``_take(groups, version)``'s future, and what starts it (to be run on the rollout loop).
        Cancelling the future calls the take off, and a batch the take got just before goes back to the
        buffer: nothing is lost between the two threads (the future is marked running only as its
        result is set)."""
        answer: Future[list[Group] | None] = Future()

        async def taking() -> None:
            try:
                batch = await self._take(groups, version)
            except asyncio.CancelledError:
                answer.cancel()
                raise
            except Exception as err:  # delivered to the trainer thread by the future
                if answer.set_running_or_notify_cancel():
                    answer.set_exception(err)
                return
            if answer.set_running_or_notify_cancel():
                answer.set_result(batch)
            else:
                await self._put_back(batch)

        def start() -> None:
            task = self._spawn(taking())
            answer.add_done_callback(lambda f: f.cancelled() and self.loop.call_soon_threadsafe(task.cancel))

        return answer, start

    def update_weights(self, payload: bytes | str, version: int) -> Future[PoolReceipt]:
        """Start: every replica loads ``payload`` (bytes or a file path) as ``version``; the future
        holds the pool's receipt (each replica's seconds, those that left)."""
        return asyncio.run_coroutine_threadsafe(self._update_weights(payload, version), self.loop)

    def start_evaluation(self, examples: list[Example], workflow: RolloutWorkflow, k: int,
                         step: int) -> Future[EvalResult]:
        """Start the held-out evaluation due after ``step`` steps on this loop, next to rollout: once every
        replica serves version ``step``, every prompt at once (the trainer holds its next weight update
        until the future is done, so one policy writes it); the future holds its result."""
        return asyncio.run_coroutine_threadsafe(self._evaluate(examples, workflow, k, step), self.loop)

    def replica_topologies(self) -> list[dict[str, str]]:
        return self.call(self.client.topologies())

    def join_p2p(self, bodies: list[dict[str, Any]]) -> None:
        self.call(self.client.join_p2p(bodies))

    def p2p_membership_changed(self) -> bool:
        """The pool client's answer, read from this thread (every push asks, twice): the loop only
        appends replicas and flips their flags, so the read is a snapshot as of now — what a round
        trip through the loop would give, 1–4 ms later."""
        return self.client.p2p_membership_changed()

    def receive_p2p(self, version: int, relayed: bool = False) -> Future[PoolReceipt]:
        """Start: every replica receives ``version`` over the p2p group (``relayed``: through each other);
        the future holds the pool's receipt."""
        return asyncio.run_coroutine_threadsafe(self._receive_p2p(version, relayed), self.loop)

    def stop(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        if self._thread.is_alive():
            self.call(self._stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    # -- on the rollout loop -----------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _started(self) -> None:
        self._changed = asyncio.Condition()
        await self.client.__aenter__()
        await self.client.wait_ready()  # episodes start after the first weight push

    def admit(self) -> int | None:
        """Reserve one group's slot (on this loop): its group id, or None when the staleness budget
        is used up. Every admitted group ends with exactly one ``deliver``."""
        if self._stopping or not self.manager.try_start():
            return None
        self.episodes += 1
        return self.episodes - 1

    async def deliver(self, group: Group | None) -> None:
        """An admitted group ended: into the buffer (None: dropped, its slot reopens)."""
        self.manager.finish(accepted=group is not None)
        assert self._changed is not None
        async with self._changed:
            if group is not None:
                self.buffer.put(group)
                self.generated_tokens += sum(len(t.output_ids) for t in group.trajectories)
                self.lengths.add(self.lengths.generated, group.trajectories)
            self._changed.notify_all()
        self._fill()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def room(self, timeout: float) -> bool:
        """Wait until admission may have moved on (a version served, a group delivered or dropped:
        wherever ``_fill`` runs) or ``timeout`` seconds pass; False on the timeout or when stopping.
        The gateway holds a session's first call here instead of answering 429 at once: a held call
        costs nothing, while an agent retrying a 429 every 100 ms costs both sides CPU."""
        if self._stopping:
            return False
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except TimeoutError:
            return False
        return not self._stopping

    def _wake_room_waiters(self) -> None:
        woken, self._room = self._room, asyncio.Event()
        woken.set()

    def _fill(self) -> None:
        """Start dataset episodes while admission allows (none when episodes come from outside:
        then wake whoever waits for ``room``)."""
        if self.prompts is None or self.workflow is None:
            self._wake_room_waiters()
            return
        while (group_id := self.admit()) is not None:
            index, example = self.prompts.hand_out()
            self._spawn(self._episode(self.workflow, index, example, group_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """``work`` as a task on this loop, kept until it ends (``_stop`` cancels those still running)."""
        task = self.loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _episode(self, workflow: RolloutWorkflow, index: int, example: Example, group_id: int) -> None:
        span = tracer.start_span("sample", attributes={"kuberl.prompt": index, "kuberl.group": group_id,
                                                       "kuberl.admitted_version": self.manager.version})
        try:
            with trace.use_span(span, end_on_exit=False):
                group = await workflow.run_episode(self.client, example, group_id)
        except Exception as err:  # surfaces in the trainer thread on the next take()
            log.exception("episode failed")
            self._error = err
            span.record_exception(err)
            group = None
        if group is not None:
            group.prompt = index
            if span.is_recording():  # a sampled one: ended when a step takes it (or it is dropped)
                span.add_event("buffered", {"kuberl.oldest_version": group.oldest_version})
                self._spans[id(group)] = span
                context = span.get_span_context()
                group.sample_span = (context.trace_id, context.span_id)
        else:
            span.set_attribute("kuberl.outcome", "no group")
            span.end()
            if self.prompts is not None:
                self.prompts.give_back(index)
        await self.deliver(group)

    def _end_span(self, group: Group, outcome: str, version: int) -> None:
        """The end of ``group``'s ``sample`` span: trained (at step ``version``) or dropped as too stale."""
        span = self._spans.pop(id(group), None)
        if span is not None:
            span.set_attributes({"kuberl.outcome": outcome, "kuberl.step": version,
                                 "kuberl.staleness": version - group.oldest_version})
            span.end()

    def _give_back(self, group: Group) -> None:
        """A group dropped as too stale: its prompt is handed out again."""
        self._end_span(group, "dropped as too stale", self.manager.version)
        self.lengths.add(self.lengths.dropped, group.trajectories)
        if self.prompts is not None and group.prompt is not None:
            self.prompts.give_back(group.prompt, stale=True)

    async def _prompt_state(self) -> dict[str, Any] | None:
        return self.prompts.state() if self.prompts is not None else None

    async def _take(self, groups: int, version: int) -> list[Group] | None:
        assert self._changed is not None
        async with self._changed:
            while True:
                if self.client.starved():
                    return None
                if self._error is not None:
                    raise RuntimeError(f"rollout failed: {self._error}") from self._error
                batch = self.buffer.take_batch(groups, version)
                if batch is not None:
                    self.observed_staleness = max(self.observed_staleness, version_lag(version, batch))
                    return batch
                self._fill()  # dropped stale groups reopen slots
                with contextlib.suppress(TimeoutError):  # wake up now and then to notice a starved pool
                    await asyncio.wait_for(self._changed.wait(), 1.0)

    def _handed_over(self, batch: list[Group], version: int, start_next: Callable[[], None] | None) -> None:
        """``batch`` is handed to the trainer for step ``version``: its prompts are trained (a ledger that
        disagrees, a prompt trained twice, fails the run at the next ``take``); then the next batch's
        take starts."""
        try:
            for group in batch:
                self._end_span(group, "trained", version)
                self.lengths.add(self.lengths.trained, group.trajectories)
                if self.prompts is not None and group.prompt is not None:
                    self.prompts.mark_trained(group.prompt)
        except KeyError as err:
            log.exception("prompt ledger")
            self._error = err
        if start_next is not None:
            start_next()

    async def _put_back(self, batch: list[Group] | None) -> None:
        """A batch taken ahead that no ``take`` asked for: its groups back at the front of the buffer,
        in their order."""
        assert self._changed is not None
        async with self._changed:
            self.buffer.items.extendleft(reversed(batch or []))
            self._changed.notify_all()

    async def _evaluate(self, examples: list[Example], workflow: RolloutWorkflow, k: int, step: int) -> EvalResult:
        """Once the replicas serve version ``step`` — or after :data:`EVAL_VERSION_WAIT_SECONDS` without
        (a lost version, a starved pool: the trainer holds its next update for this evaluation, so
        waiting on could only stall both), said in the log and in the result's versions."""
        deadline = self.loop.time() + EVAL_VERSION_WAIT_SECONDS
        while self.manager.version < step and not self._stopping:
            if (left := deadline - self.loop.time()) <= 0:
                log.warning("the evaluation due after step %d starts while the replicas serve version %d: version "
                            "%d did not arrive within %.0f s", step, self.manager.version, step,
                            EVAL_VERSION_WAIT_SECONDS)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._served.wait(), left)
        return await evaluate(self.client, examples, workflow, k, step)

    async def _update_weights(self, payload: bytes | str, version: int) -> PoolReceipt:
        """Every replica swaps weights between its engine steps; requests in flight go on (their
        tokens carry the version that wrote them), so generation never stops for an update."""
        receipt = await self.client.push_weights(payload, version)
        self._serving(version)
        return receipt

    async def _receive_p2p(self, version: int, relayed: bool) -> PoolReceipt:
        receipt = await self.client.receive_p2p(version, relayed)
        self._serving(version)
        return receipt

    def _serving(self, version: int) -> None:
        """Every replica serves ``version``: admission may move on, an evaluation due at it may start."""
        self.manager.set_version(version)
        served, self._served = self._served, asyncio.Event()
        served.set()
        self._fill()

    async def _stop(self) -> None:
        self._stopping = True
        self._wake_room_waiters()
        self._served.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.__aexit__(None, None, None)
