"""Client of the inference pool: load-balanced generate, pause/resume, weight pushes.

A request goes to the replica with the fewest requests in flight. If it comes back aborted (the
replica paused for a weight update), it is resubmitted as prompt + the tokens generated so far,
with the remaining token budget; the pieces are concatenated, so each token keeps the version
that wrote it.

Containment: a replica that cannot be reached, answers 5xx (its engine crashed or is broken),
fails its ``/health`` check (a hung engine; probed every ``health_interval`` seconds, failing after
``health_timeout``) or lags behind its peers in taking a weight version (a *straggler*: not done
``max(STRAGGLER_FLOOR, STRAGGLER_FACTOR × the first replica's time)`` after the push began) is taken
out of rotation, and the requests it holds are sent to another replica — a fault of one replica
never fails the rollout, and a weight push never waits for a hung one. It stays out for a back-off
that doubles with each failure in a row (1 s, 2 s, … ``BACKOFF_MAX``; a served request resets it), so
a replica that keeps failing costs little. Once it answers again it first gets the newest weights
(broadcast: from here; p2p: the trainer re-forms the exchange group with it, see ``p2p_members``),
then requests. A 4xx is the request's own fault (:class:`Rejected`): it is raised to the caller,
not retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
from opentelemetry import propagate, trace

from ..api.progress import PoolReceipt
from ..auth import bearer
from ..inference.contract import FINISH_ABORT, FINISH_LENGTH, GenerateReply, Generation, ReplyLimits

log = logging.getLogger("kuberl.rollout")
tracer = trace.get_tracer("kuberl.rollout")  # a no-op until kuberl.tracing.set_up installs a provider
WeightPayload = bytes | str  # safetensors bytes, or the path of a safetensors file (weightSync.mode disk)
STRAGGLER_FLOOR = 0.5  # s a replica may lag behind its first peer in taking a weight version (≥ 8× the slowest
STRAGGLER_FACTOR = 4.0  # healthy p2p receive under benchmarks/chaos.py), or this many times the first peer's time
CONTROL_SLACK_SECONDS = 30.0  # a control request's HTTP limit beyond push_timeout (the push's own limit comes first)
BACKOFF_MAX = 30.0  # seconds out of rotation after many failures in a row


class ReplicaFault(RuntimeError):
    """The replica, not the request, failed (5xx, or it left rotation): retry on another replica."""


class Rejected(RuntimeError):
    """The replica refused the request itself (HTTP 4xx): no replica would answer it differently.
    ``reason``: the replica's own message (it names the field), without the replica's address."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.reason = status, reason


REPLICA_ERRORS = (OSError, TimeoutError, aiohttp.ClientError, ReplicaFault)


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    needs_weights: bool = False  # restarted or missed a push: not used until it has the newest
    answered: bool = False  # its /health has said 200 once: from then on, not answering means it is gone
    back: bool = False  # out of rotation, and its /health said 200 since its back-off ended: may rejoin
    failures: int = 0  # times it left rotation since it last served a request (sets the back-off)
    left: asyncio.Event = field(default_factory=asyncio.Event)  # set when it leaves rotation (then replaced)

    def backoff(self) -> float:
        """Seconds out of rotation after the ``failures``-th failure in a row: 1, 2, 4, … ``BACKOFF_MAX``."""
        return min(BACKOFF_MAX, 2.0 ** max(0, self.failures - 1))


@dataclass
class InferenceClient:
    urls: list[str]
    token: str = field(repr=False)  # the experiment's API token, sent with every request (kuberl.auth)
    timeout: float = 600.0
    push_timeout: float = 600.0  # spec.weightSync.timeoutSeconds: the longest one weight exchange may take
    health_interval: float = 2.0
    health_timeout: float = 10.0
    return_routes: bool = False  # ask every generation for its MoE routes (spec.algorithm.routingReplay)
    limits: ReplyLimits | None = None  # the trained model's: a reply outside them is its replica's fault
    replicas: list[Replica] = field(init=False)
    _session: aiohttp.ClientSession | None = field(default=None, init=False)
    _control: aiohttp.ClientSession | None = field(default=None, init=False)
    _latest: tuple[WeightPayload, int] | None = field(default=None, init=False)
    _rejoiner: asyncio.Task[None] | None = field(default=None, init=False)
    _watchers: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)  # one per replica
    _members: list[Replica] = field(default_factory=list, init=False)  # the p2p exchange group's replicas

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no inference replicas configured")
        self.replicas = [Replica(u.rstrip("/")) for u in self.urls]

    async def __aenter__(self) -> InferenceClient:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        headers = bearer(self.token)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                              headers=headers)
        control = aiohttp.ClientTimeout(total=max(self.timeout, self.push_timeout + CONTROL_SLACK_SECONDS))
        self._control = aiohttp.ClientSession(timeout=control, headers=headers)  # _each_in_step bounds pushes
        for replica in self.replicas:
            self._watch(replica)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [*self._watchers.values(), self._rejoiner]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for session in (self._session, self._control):
            if session:
                await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use `async with InferenceClient(...)`")
        return self._session

    def starved(self) -> bool:
        """Every replica lost its weights and there is no whole state here to give them (p2p mode):
        generation cannot go on until the trainer re-sends the weights (``WeightSync.recover``)."""
        return self._latest is None and all(r.needs_weights for r in self.replicas)

    def _pick(self) -> Replica | None:
        now = time.monotonic()
        alive = [r for r in self.replicas if r.down_until <= now and not r.needs_weights]
        return min(alive, key=lambda r: r.in_flight) if alive else None

    def _lost(self, replica: Replica, err: BaseException) -> None:
        """Take ``replica`` out of rotation for its back-off; requests waiting on it go elsewhere (``_on``)."""
        if not replica.needs_weights and any(r is replica for r in self.replicas):  # a drained one has left
            replica.failures += 1
            log.warning("replica %s failed (%s); out of rotation for %.0f s, then until it is back", replica.url,
                        err or type(err).__name__, replica.backoff())  # fmt: skip
        replica.needs_weights, replica.back = True, False
        replica.down_until = time.monotonic() + replica.backoff()
        replica.left.set()
        replica.left = asyncio.Event()

    async def _on(self, replica: Replica, path: str, **kwargs: Any) -> dict[str, Any]:
        """POST ``path`` to ``replica``; ReplicaFault as soon as the replica leaves rotation."""
        result: dict[str, Any] = await self._leaving_aborts(replica, self._post(replica, path, **kwargs))
        return result

    def _watch(self, replica: Replica) -> None:
        """Probe ``replica`` every ``health_interval``, on its own (one that hangs delays no other)."""
        self._watchers[replica.url] = asyncio.create_task(self._watch_one(replica), name=f"health {replica.url}")

    def resize(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """The pool is now ``urls`` (on the client's loop). A new replica joins as one that came back:
        out of rotation until its health check answers, then given the newest weights (by the p2p
        group re-formed with it at the next push, or the whole state it is sent) before any request.
        A replica no longer listed is drained: no new request goes to it, the ones in flight there
        are abandoned and retried on the others (as when a replica fails), and it leaves the p2p group
        at the next push. Returns (joined, left)."""
        wanted = [u.rstrip("/") for u in urls]
        if not wanted:
            raise ValueError("a pool needs at least one replica")
        known = {r.url: r for r in self.replicas}
        joined = {u: Replica(u, needs_weights=True) for u in wanted if u not in known}
        left = [r for r in self.replicas if r.url not in wanted]
        for replica in left:
            replica.needs_weights, replica.back = True, False
            replica.left.set()  # requests waiting on it raise ReplicaFault and go elsewhere
            task = self._watchers.pop(replica.url, None)
            if task is not None:
                task.cancel()
        self.replicas = [known.get(u) or joined[u] for u in wanted]
        for replica in joined.values():
            self._watch(replica)
        if joined or left:
            log.info("inference pool resized to %d replicas: joined %s, left %s", len(self.replicas), list(joined),
                     [r.url for r in left])
        return list(joined), [r.url for r in left]

    async def _watch_one(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self._probe(replica)

    async def _probe(self, replica: Replica) -> None:
        """In rotation: a replica that says it is unhealthy (any answer but 200) leaves; one that does
        not answer leaves only if it answered before (a replica still starting does not listen yet).
        Out of rotation, past its back-off: a 200 marks it ``back`` (it may rejoin)."""
        if replica.needs_weights and (replica.back or replica.down_until > time.monotonic()):
            return
        try:
            await self._get(replica, "/health", timeout=aiohttp.ClientTimeout(total=self.health_timeout))
            replica.answered = True
            replica.back = replica.needs_weights
        except (ReplicaFault, Rejected) as err:
            self._lost(replica, err)
        except REPLICA_ERRORS as err:
            if replica.answered:
                self._lost(replica, err)

    async def _each_in_step(self, replicas: list[Replica], call: Callable[[Replica], Awaitable[Any]],
                            what: str, coupled: bool = False) -> tuple[list[Replica], PoolReceipt]:
        """``call`` every replica at once; those that fail or straggle (not done ``max(STRAGGLER_FLOOR,
        STRAGGLER_FACTOR × t₁)`` after the start, t₁ the first one's time), or are not done within
        ``push_timeout`` (spec.weightSync.timeoutSeconds) of the start, leave rotation. ``coupled``
        (each call waits on the others): at the first failure the calls still running are given up,
        their replicas staying in rotation. Returns the replicas that completed, and the receipt: each one's
        seconds, and why each one that left did."""
        start = time.monotonic()
        calls = {asyncio.ensure_future(self._leaving_aborts(r, call(r))): r for r in replicas}
        pending, completed, straggling, given_up = set(calls), [], None, False
        limit = start + self.push_timeout
        receipt = PoolReceipt()

        def lose(replica: Replica, err: BaseException) -> None:
            receipt.lost[replica.url] = str(err) or type(err).__name__
            self._lost(replica, err)

        try:
            while pending:
                deadline = limit if straggling is None else min(limit, straggling)
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
                failed = False
                for task in done:
                    err = task.exception()
                    if err is None:
                        completed.append(calls[task])
                        receipt.served[calls[task].url] = time.monotonic() - start
                    elif isinstance(err, REPLICA_ERRORS):
                        lose(calls[task], err)
                        failed = True
                    else:
                        raise err
                if coupled and failed and pending:
                    log.warning("%s: a replica failed while its peers waited on it; %d of them go without it",
                                what, len(pending))
                    given_up = True
                    break
                if straggling is None and completed:
                    straggling = start + max(STRAGGLER_FLOOR, STRAGGLER_FACTOR * (time.monotonic() - start))
            over = time.monotonic() - start
            why = (f"not done within weightSync.timeoutSeconds ({self.push_timeout:g} s)" if over >= self.push_timeout
                   else f"not done {over:.1f} s after the start, its peers were")
            for task in () if given_up else pending:
                lose(calls[task], ReplicaFault(f"{what}: {why}"))
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return completed, receipt

    async def _leaving_aborts(self, replica: Replica, work: Awaitable[Any]) -> Any:
        """``work`` on ``replica``; ReplicaFault as soon as the replica leaves rotation."""
        left = replica.left
        request = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(left.wait())
        try:
            done, _ = await asyncio.wait({request, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
        if request not in done:
            raise ReplicaFault(f"{replica.url} left rotation with this request in flight")
        return request.result()

    def _start_rejoin(self) -> None:
        """In the background: replicas that are ``back`` get the newest whole state (broadcast and disk
        modes; in p2p mode the trainer re-forms the group with them, see ``p2p_members``), then rotation."""
        if self._latest is None or (self._rejoiner is not None and not self._rejoiner.done()):
            return
        if any(r.needs_weights and r.back for r in self.replicas):
            self._rejoiner = asyncio.create_task(self._rejoin(), name="replica-rejoin")

    async def _rejoin(self) -> None:
        for replica in [r for r in self.replicas if r.needs_weights and r.back]:
            if self._latest is None:
                return
            try:
                await self._send_weights(replica, *self._latest)
                replica.needs_weights = replica.back = False
                log.info("replica %s is back with the newest weights", replica.url)
            except REPLICA_ERRORS as err:
                replica.back = False  # the next health probe that finds it well tries again
                log.info("replica %s not back yet: %s", replica.url, err)

    async def _post(self, replica: Replica, path: str, control: bool = False, **kwargs: Any) -> dict[str, Any]:
        session = self._control if control else self._session
        if session is None:
            raise RuntimeError("use `async with InferenceClient(...)`")
        async with session.post(replica.url + path, **kwargs) as resp:
            return await self._answer(replica, path, resp)

    @staticmethod
    async def _answer(replica: Replica, path: str, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        if resp.status == 200:
            return await resp.json()
        reason = (await resp.text())[:2000]
        message = f"{replica.url}{path}: HTTP {resp.status}: {reason}"
        if resp.status >= 500:
            raise ReplicaFault(message)
        raise Rejected(resp.status, message, reason)

    def p2p_members(self) -> list[Replica]:
        """The replicas a p2p exchange group is formed with: those in rotation and those ``back``."""
        return [r for r in self.replicas if not r.needs_weights or r.back]

    def p2p_membership_changed(self) -> bool:
        """A member left rotation or a replica came back since the group was formed: re-form it."""
        return [r.url for r in self.p2p_members()] != [r.url for r in self._members]

    async def topologies(self) -> list[dict[str, str]]:
        """Start forming a p2p group with ``p2p_members()``: each one's place (node / fabric / zone from
        its pod labels), in replica order. A member that does not answer within ``health_timeout``
        raises (the group is not formed; this version goes by broadcast)."""
        self._members = self.p2p_members()
        if not self._members:
            raise ReplicaFault("no replica is in rotation or back to form a group with")
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)
        return list(await asyncio.gather(*(self._get(r, "/topology", timeout=timeout) for r in self._members)))

    async def join_p2p(self, bodies: list[dict[str, Any]]) -> None:
        """Hand member i its part of the p2p plan; it joins the exchange group in the background."""
        await asyncio.gather(*(self._post(r, "/weights/p2p/join", control=True, json=b)
                               for r, b in zip(self._members, bodies, strict=True)))  # fmt: skip

    async def receive_p2p(self, version: int, relayed: bool = False) -> PoolReceipt:
        """Every member receives ``version`` from the trainer ranks and swaps it in. A member that fails
        or straggles leaves rotation and the group (re-formed at the next push without it, see
        ``p2p_membership_changed``); the others serve ``version`` and are in rotation. ``relayed`` (the
        members forward pieces to each other): the first member to fail ends the exchange for all —
        the others wait on what it should forward, so they stay in rotation without the version.
        Raises only when none took it (the trainer then re-sends it by broadcast). A whole-state
        payload kept from an earlier broadcast is dropped (it is older now: a replica that comes back
        waits for the trainer rather than serve it)."""
        served, receipt = await self._each_in_step(
            self._members, lambda r: self._post(r, f"/weights/p2p/receive?version={version}", control=True),
            f"p2p weights version {version}", coupled=relayed)  # fmt: skip
        if not served:
            raise ReplicaFault(f"no replica received weights version {version} over p2p")
        self._latest = None
        for replica in served:
            replica.needs_weights = replica.back = False
        return receipt

    async def _get(self, replica: Replica, path: str, **kwargs: Any) -> dict[str, Any]:
        if self._control is None:
            raise RuntimeError("use `async with InferenceClient(...)`")
        async with self._control.get(replica.url + path, **kwargs) as resp:
            return await self._answer(replica, path, resp)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while True:
                try:
                    async with self.session.get(replica.url + "/health") as resp:
                        if resp.status == 200:
                            replica.answered = True
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"inference replica {replica.url} not healthy after {timeout:.0f}s")
                await asyncio.sleep(0.2)

    async def generate(self, input_ids: list[int], n: int, max_new_tokens: int, temperature: float,
                       top_p: float) -> list[Generation]:
        """``n`` completions of ``input_ids``; aborted ones are resumed until they finish (concurrently;
        no task is made for the others)."""
        outputs = await self._generate(input_ids, n, max_new_tokens, temperature, top_p)
        aborted = [i for i, o in enumerate(outputs) if o.finish_reason == FINISH_ABORT]
        resumed = await asyncio.gather(*(
            self._complete(input_ids, outputs[i], max_new_tokens, temperature, top_p) for i in aborted))
        for i, out in zip(aborted, resumed, strict=True):
            outputs[i] = out
        return outputs

    async def _generate(self, input_ids: list[int], n: int, max_new_tokens: int, temperature: float,
                        top_p: float) -> list[Generation]:
        """One ``/generate`` on the least busy healthy replica, retried on another while replicas fail."""
        body = {"input_ids": input_ids, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, **({"return_routes": True} if self.return_routes else {})}
        while True:
            self._start_rejoin()
            replica = self._pick()
            if replica is not None and (outputs := await self._generate_on(replica, body, n, len(input_ids))):
                return outputs
            await asyncio.sleep(0.2)  # every replica is down (wait for one to come back), or this one failed

    async def _generate_on(self, replica: Replica, body: dict[str, Any], n: int,
                           prompt_tokens: int) -> list[Generation] | None:
        """``body``'s ``/generate`` on ``replica``, a ``generate`` span of the sample's trace (the replica's
        own spans join it): the outputs, or None when the replica failed (it leaves rotation)."""
        replica.in_flight += n
        attributes = {"kuberl.replica": replica.url, "kuberl.samples": n, "kuberl.prompt_tokens": prompt_tokens}
        with tracer.start_as_current_span("generate", attributes=attributes) as span:
            headers: dict[str, str] = {}
            propagate.inject(headers)  # W3C traceparent
            try:
                reply = self._checked(replica, await self._on(replica, "/generate", json=body, headers=headers), n,
                                      prompt_tokens)
            except REPLICA_ERRORS as err:
                span.record_exception(err)
                self._lost(replica, err)
                return None
            finally:
                replica.in_flight -= n
            span.set_attributes({"kuberl.version": reply.version,
                                 "kuberl.output_tokens": sum(len(o.output_ids) for o in reply.outputs),
                                 "kuberl.aborted": sum(o.finish_reason == FINISH_ABORT for o in reply.outputs)})
        if self._latest is not None and reply.version < self._latest[1] - 1:
            self._lost(replica, RuntimeError(f"serves version {reply.version}, restarted?"))
        else:
            replica.failures = 0
        return reply.outputs

    def _checked(self, replica: Replica, data: Any, n: int, prompt_tokens: int) -> GenerateReply:
        """``data`` as a reply to ``n`` generations, within ``limits``; else ReplicaFault: a replica that
        answers malformed or impossible output (ids past the vocabulary, experts the model lacks) is
        taken out of rotation and the request goes elsewhere — never into a batch the trainer indexes."""
        try:
            reply = GenerateReply.from_json(data)
        except ValueError as err:
            raise ReplicaFault(f"{replica.url}/generate: a malformed reply: {err}") from err
        if self.limits is not None and (problem := self.limits.problem(reply, n, prompt_tokens)):
            raise ReplicaFault(f"{replica.url}/generate: {problem}")
        return reply

    async def _complete(self, input_ids: list[int], out: Generation, budget: int, temperature: float,
                        top_p: float) -> Generation:
        """Resume an aborted generation (its replica paused for a weight update) until it finishes."""
        while out.finish_reason == FINISH_ABORT and len(out.output_ids) < budget:
            (more,) = await self._generate(input_ids + out.output_ids, 1, budget - len(out.output_ids),
                                           temperature, top_p)
            out = out.then(more)
        if out.finish_reason == FINISH_ABORT:
            out.finish_reason = FINISH_LENGTH
        return out

    async def pause_all(self) -> None:
        await asyncio.gather(*(self._post(r, "/pause", control=True) for r in self.replicas))

    async def resume_all(self) -> None:
        await asyncio.gather(*(self._post(r, "/resume", control=True) for r in self.replicas))

    async def _send_weights(self, replica: Replica, payload: WeightPayload, version: int) -> None:
        """The whole state: safetensors bytes in the body, or (disk mode) a file path the replica reads."""
        if isinstance(payload, bytes):
            await self._post(replica, f"/update_weights?version={version}", control=True, data=payload)
        else:
            await self._post(replica, f"/update_weights?version={version}&path={quote(payload)}", control=True)

    async def push_weights(self, payload: WeightPayload, version: int) -> PoolReceipt:
        """Naive broadcast: the full state to every replica in rotation; each swaps it in between two
        engine steps. A replica that fails or straggles leaves rotation and gets it when it is back."""
        self._latest = (payload, version)
        _, receipt = await self._each_in_step([r for r in self.replicas if not r.needs_weights],
                                              lambda r: self._send_weights(r, payload, version),
                                              f"weights version {version}")
        return receipt
