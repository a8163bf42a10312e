"""The OpenAI-compatible gateway: an agent's calls become the trainer's trajectories.

Runs on trainer rank 0, on the rollout loop, in front of the inference pool (``spec.agent``)::

    POST /v1/chat/completions   messages (+ tools, stream) → one assistant turn of the policy
    POST /v1/completions        prompt → text
    GET  /v1/models             the one model: the experiment's policy
    GET  /v1/tasks/next         a task of spec.dataset: {"group", "prompt", "answer"}, each handed
                                out groupSize times with the same group (use it as X-KubeRL-Group)
    POST /v1/sessions/{id}/reward   {"reward": x} or {"completion": text} (scored by spec.reward
                                against the group's task): ends the session
    GET  /health                open; everything else needs the experiment's API token

Completion calls name their session (``X-KubeRL-Session``) and may name its group
(``X-KubeRL-Group``); ``kuberl.gateway.sessions`` turns sessions into rewarded trajectories. While
the staleness budget is used up, a session's first call waits for a slot (up to
``ADMISSION_WAIT_SECONDS``; held calls cost nothing, a retry storm costs the trainer's own CPU),
then is refused with 429 and ``Retry-After`` (OpenAI clients retry on their own). Sampling uses
the experiment's ``spec.rollout`` temperature and top-p, whatever a request asks, so the policy is
trained on what it sampled; each call gets at most what is left of the session's
``spec.rollout.maxNewTokens``. A streamed reply arrives in one piece when the turn is done.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from transformers import PreTrainedTokenizerBase

from ..agent.workflow import cut_turn
from ..api.contract import HEADER_SESSION
from ..auth import require_token
from ..data.datasets import Example
from ..inference.contract import FINISH_LENGTH, FINISH_STOP
from ..jsonbody import read_json
from ..models.text import TextCodec
from ..rewards.pool import Scorer
from ..rollout.client import Rejected
from ..rollout.controller import RolloutController
from ..rollout.workflow import without_eos
from . import chat
from .params import RequestError, error, requested_tokens, reward_value, session_headers, stop_strings
from .refusals import RefusalBudget
from .sessions import Session, SessionGroup, SessionTable, fair_share
from .tasks import TaskDealer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kuberl.gateway")
tracer = trace.get_tracer("kuberl.gateway")  # a no-op until kuberl.tracing.set_up installs a provider
SHUTDOWN_SECONDS = 2.0  # how long stop() lets calls in flight finish before it cancels them
ADMISSION_WAIT_SECONDS = 20.0  # a new session's first call waits this long for a slot before its 429
RETRY_AFTER_SECONDS = 1  # Retry-After takes whole seconds ...
RETRY_AFTER_MS = 100  # ... OpenAI clients honour retry-after-ms first: a slot reopens within a training step
RECLAIM_CHECK_SECONDS = 1.0  # how often a held first call looks for a group to reclaim
RECLAIM_IDLE_SECONDS = 15.0  # another client's idle group may be taken back for a waiting one after this
RECLAIM_PENALTY_SECONDS = 60.0  # a client a group was reclaimed from is served after the others this long
TOKENIZE_AT_ONCE = 2  # requests rendered and tokenized at once (in worker threads)


@dataclass
class GatewayConfig:
    model: str
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    session_timeout: float
    admission_wait: float = ADMISSION_WAIT_SECONDS
    reclaim_idle: float = RECLAIM_IDLE_SECONDS  # a group idle this long may be reclaimed (SessionTable.reclaim)
    reward: Scorer | None = None  # spec.reward's: scores {"completion": ...} against the task's answer


@dataclass
class GatewayStats:
    sessions: int = 0
    completions: int = 0
    rejected: int = 0  # 429s: the staleness budget was used up (for ``admission_wait`` seconds)
    held: int = 0  # first calls that waited for the staleness budget (then admitted or refused)
    groups: int = 0  # delivered to the trainer
    groups_dropped: int = 0  # fewer than groupSize rewarded episodes (expired sessions)
    prefix_breaks: int = 0

    def as_dict(self, expired: int) -> dict[str, int]:
        return {**self.__dict__, "expired": expired}


class Gateway:
    def __init__(self, controller: RolloutController, tokenizer: PreTrainedTokenizerBase, config: GatewayConfig,
                 token: str, tasks: Iterator[Example] | None = None):
        self.controller, self.config, self.token = controller, config, token
        self.codec = TextCodec(tokenizer)
        self.table = SessionTable(config.group_size, config.session_timeout)
        self.tasks = TaskDealer(tasks, config.group_size) if tasks is not None else None
        self.stats = GatewayStats()
        self._reaper: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._tokenizing: asyncio.Semaphore | None = None  # made on the controller's loop (``_tokenize``)
        self.refusals = RefusalBudget()  # per client: refused calls before its 429s
        self._waiting: collections.Counter[str] = collections.Counter()  # client → first calls held for a slot
        self._reclaimed_at: dict[str, float] = {}  # client → when a group of its was last reclaimed

    # -- lifecycle (on the controller's loop) ---------------------------------------------------
    def start_in(self, port: int, host: str = "") -> None:
        """Serve on ``host`` (the pod's IP; "": every address) and ``port``."""
        self.controller.call(self._start(port, host), timeout=30)

    def stop(self) -> None:
        self.controller.call(self._stop(), timeout=30)

    def summary(self) -> dict[str, int]:
        """Sessions, completions, 429s (the budget's; ``limited``: clients refused too often), groups
        delivered, prefix breaks, sessions expired, groups reclaimed from a client holding too many."""
        return {**self.stats.as_dict(self.table.expired), "limited": self.refusals.limited,
                "reclaimed": self.table.reclaimed}

    async def _start(self, port: int, host: str) -> None:
        # agents poll (counts are in summary()); calls still in flight when the run ends are cancelled
        # after SHUTDOWN_SECONDS rather than aiohttp's 60 s, which outlasted stop()'s own timeout
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
        await self._runner.setup()
        await web.TCPSite(self._runner, host or "0.0.0.0", port).start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        log.info("gateway on port %d (model %r)", port, self.config.model)

    async def _stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for group in self.table.expire(time.monotonic()):
                await self._deliver(group)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.refusals.middleware(), require_token(self.token, {"/health"})])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/tasks/next", self.next_task)
        app.router.add_post("/v1/sessions/{session}/reward", self.reward)
        app.router.add_get("/health", self.health)
        return app

    # -- routes ---------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        try:
            messages = chat.checked_messages(body.get("messages"))
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise RequestError("tools: must be a list", "tools")
            prompt = await self._tokenize(chat.render, self.codec, messages, tools)
            session = await self._session(request)
            if isinstance(session, web.Response):
                return session
            ids, finish, counts = await self._complete(session, prompt, body, request.headers, cut_at_call=True)
        except RequestError as err:
            return error(400, str(err), "invalid_request_error", err.param)
        reply = chat.reply_of(self._text(ids), finish)
        if reply.calls:
            session.tool_called()
        created = int(time.time())
        if not body.get("stream"):
            return web.json_response(chat.chat_completion(reply, self.config.model, created, counts))
        return await self._stream(request, chat.chat_chunks(reply, self.config.model, created, counts))

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            prompt_text = body.get("prompt")
            if not isinstance(prompt_text, str) or not prompt_text:
                raise RequestError("prompt: a non-empty string is required", "prompt")
            session = await self._session(request)
            if isinstance(session, web.Response):
                return session
            prompt = await self._tokenize(chat.encode, self.codec, prompt_text)
            ids, finish, counts = await self._complete(session, prompt, body, request.headers,
                                                       cut_at_call=False)
        except RequestError as err:
            return error(400, str(err), "invalid_request_error", err.param)
        return web.json_response(chat.text_completion(self._text(ids), finish, self.config.model,
                                                      int(time.time()), counts))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "kuberl"}]})

    async def next_task(self, request: web.Request) -> web.Response:
        if self.tasks is None:
            return error(404, "this experiment hands out no tasks (spec.dataset)", "not_found_error")
        key, example = self.tasks.next()
        return web.json_response({"group": key, "prompt": example.prompt, "answer": example.answer})

    async def reward(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session"]
        session = self.table.get(session_id)
        if session is None:
            return error(404, f"no open session {session_id[:128]!r}", "not_found_error", HEADER_SESSION)
        if session.ended:
            return error(409, "this session has ended already", "invalid_request_error")
        body = await self._body(request)
        try:
            value = await self._reward_of(body, self.table.group_of(session_id).key)
        except RequestError as err:
            return error(400, str(err), "invalid_request_error", err.param)
        if self.table.get(session_id) is not session or session.ended:  # expired or ended while scored
            return error(409, "this session ended while its reward was being scored", "invalid_request_error")
        group = self.table.end(session_id, value)
        if group is not None:
            await self._deliver(group)
        return web.json_response({"session": session_id, "reward": value, "tokens": session.generated_tokens})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.summary()})

    # -- steps ----------------------------------------------------------------------------------
    async def _tokenize(self, render: Callable[..., list[int]], *args: Any) -> list[int]:
        """``render(*args)`` off the event loop (a megabyte of chat text takes the tokenizer and a
        template a while, and every other agent's request, the rewards and /health wait on this loop),
        at most ``TOKENIZE_AT_ONCE`` at a time: however many agents send long histories at once, the
        tokenizer takes that many of rank 0's cores, not all of them."""
        if self._tokenizing is None:
            self._tokenizing = asyncio.Semaphore(TOKENIZE_AT_ONCE)
        async with self._tokenizing:
            return await asyncio.to_thread(render, *args)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object")
        return body

    async def _session(self, request: web.Request) -> Session | web.Response:
        """The request's session (joining its group). A new session with no staleness budget left
        waits up to ``admission_wait`` seconds for a slot (the trainer catching up, a group reclaimed
        from a client holding more than its share), then gets a 429."""
        session_id, key = session_headers(request.headers)
        client = request.remote or ""
        known = self.table.get(session_id) is not None
        session = self.table.join(session_id, key, time.monotonic(), lambda: self._admit(client), client)
        if session is None:
            self.stats.held += 1
            self._waiting[client] += 1
            try:
                session = await self._held(session_id, key, client)
            finally:
                self._waiting[client] -= 1
            if session is None:
                self.stats.rejected += 1
                return error(429, "the staleness budget is used up: the trainer has not caught up yet; retry "
                                  f"after {RETRY_AFTER_SECONDS} s", "rate_limit_error",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS), "retry-after-ms": str(RETRY_AFTER_MS)})
        if session.ended:
            raise RequestError(f"header {HEADER_SESSION}: this session has ended", HEADER_SESSION)
        self.stats.sessions += int(not known)
        return session

    async def _held(self, session_id: str, key: str | None, client: str) -> Session | None:
        """Join once a slot opens — the trainer moving on, or a group reclaimed for ``client`` — within
        ``admission_wait`` seconds; None after that (or when the rollout stops)."""
        deadline = time.monotonic() + self.config.admission_wait
        while True:
            if (reclaimed := self.table.reclaim(client, time.monotonic(), self.config.reclaim_idle)) is not None:
                self._reclaimed_at[reclaimed.client] = time.monotonic()
                await self._deliver(reclaimed)
            elif not await self.controller.room(min(deadline - time.monotonic(), RECLAIM_CHECK_SECONDS)) and (
                    time.monotonic() >= deadline or self.controller.stopping):
                return None
            session = self.table.join(session_id, key, time.monotonic(), lambda: self._admit(client), client)
            if session is not None:
                return session

    def _admit(self, client: str) -> int | None:
        """A new group's slot for ``client`` (``controller.admit``), unless another client waits for one
        and either ``client`` had a group reclaimed within ``RECLAIM_PENALTY_SECONDS`` (it abandons its
        sessions: it is served last) or holds its fair share of the open groups or more."""
        now = time.monotonic()

        def abandons(c: str) -> bool:
            return now - self._reclaimed_at.get(c, -math.inf) < RECLAIM_PENALTY_SECONDS

        others = {c for c, n in self._waiting.items() if n > 0 and c != client and not abandons(c)}
        if others and abandons(client):
            return None
        if others:
            held = self.table.open_groups()
            if len(held.get(client, [])) >= fair_share(held, others | {client}):
                return None
        return self.controller.admit()

    async def _complete(self, session: Session, prompt: list[int], body: dict[str, Any], headers: Mapping[str, str],
                        cut_at_call: bool) -> tuple[list[int], str, tuple[int, int]]:
        """One policy turn of ``session`` after ``prompt``: (its tokens, finish reason, (prompt, completion)
        token counts). Traced as an ``agent_turn`` span in the trace the call's ``traceparent`` header names
        (an agent instrumented with OpenTelemetry sees its calls, their generation and the replica's engine
        in its own trace; a new trace when it sends none)."""
        if session.busy:
            raise RequestError(f"header {HEADER_SESSION}: this session has a call in flight; an episode's "
                                    "calls come one after the other", HEADER_SESSION)
        session.busy = True
        try:
            with tracer.start_as_current_span("agent_turn", context=propagate.extract(headers), kind=SpanKind.SERVER,
                                              attributes={"kuberl.session": session.id,
                                                          "kuberl.prompt_tokens": len(prompt)}) as span:
                turn = await self._turn(session, prompt, body, cut_at_call)
                span.set_attributes({"kuberl.finish": turn[1], "kuberl.output_tokens": turn[2][1]})
                return turn
        except RequestError:  # a refused first call leaves no session behind to hold a group's slot
            if (emptied := self.table.forget(session.id)) is not None:
                await self._deliver(emptied)
            raise
        finally:
            session.busy = False

    async def _turn(self, session: Session, prompt: list[int], body: dict[str, Any],
                    cut_at_call: bool) -> tuple[list[int], str, tuple[int, int]]:
        """Generate first, then record the turn: a call that fails leaves the session as it was."""
        stops, asked = stop_strings(body), requested_tokens(body)  # checked before the session changes
        left = session.tokens_left(prompt, self.config.max_new_tokens)
        budget = left if asked is None else min(asked, left)
        ids, logprobs, versions, finish, routes = await self._generate(prompt, budget, stops, cut_at_call)
        breaks = session.prefix_breaks
        context = session.context(prompt)  # == prompt: a continuation's prefix is the segment itself
        self.stats.prefix_breaks += session.prefix_breaks - breaks
        session.policy(ids, logprobs, versions, finish, routes)
        if budget > 0:
            self.stats.completions += 1
            session.touched = time.monotonic()
        return ids, finish, (len(context), len(ids))

    async def _generate(self, prompt: list[int], budget: int, stops: list[str],
                        cut_at_call: bool) -> tuple[list[int], list[float], list[int], str, torch.Tensor | None]:
        """The policy's turn after ``prompt``: (tokens, their log-probs, their versions, finish reason,
        the generation's MoE routes when asked for); nothing (finish "length") when the segment's
        budget is spent."""
        if budget <= 0:
            return [], [], [], FINISH_LENGTH, None
        cfg = self.config
        try:
            (gen,) = await self.controller.client.generate(prompt, 1, budget, cfg.temperature, cfg.top_p)
        except Rejected as err:  # e.g. a history longer than the model's context
            field = "messages" if cut_at_call else "prompt"
            raise RequestError(f"{field}: {err.reason}", field) from err
        ids, stopped = cut_turn(gen.output_ids, self._text, stops, cut_at_call)
        finish = FINISH_STOP if stopped else gen.finish_reason or FINISH_LENGTH
        return ids, gen.logprobs[:len(ids)], gen.versions[:len(ids)], finish, gen.routes

    @staticmethod
    async def _stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _text(self, ids: list[int]) -> str:
        return self.codec.tokenizer.decode(without_eos(ids, self.codec.eos_id), skip_special_tokens=True)

    async def _reward_of(self, body: dict[str, Any], key: str) -> float:
        if "reward" in body:
            return reward_value(body["reward"])
        completion = body.get("completion")
        if not isinstance(completion, str):
            raise RequestError('give {"reward": number} or {"completion": text} (scored by spec.reward)',
                                    "reward")
        task = self.tasks.task(key) if self.tasks is not None else None
        if task is None or self.config.reward is None:
            raise RequestError(f"completion: the session's group {key[:128]!r} is not a task of "
                                    "/v1/tasks/next; send {\"reward\": number}", "completion")
        prompt = task.prompt if isinstance(task.prompt, str) else json.dumps(task.prompt)
        return await self.config.reward.score(prompt, completion, task.answer, task.row)

    async def _deliver(self, group: SessionGroup) -> None:
        result = group.result()
        self.stats.groups += result is not None
        self.stats.groups_dropped += result is None
        await self.controller.deliver(result)

