"""What the Tinker front door serves, for several clients at once: their sessions, training models,
saved weights and samplers, each visible only to the client (API key) that made it.

Training work (create a model, forward/backward, optimizer step, save weights) runs one piece at a
time on a worker thread, taken round-robin over the clients that have work waiting — so one client's
long queue delays another's by at most one piece of work — and, within a client, in the order it was
sent (the SDK sends a model's requests in its own order: an optimizer step after the forward/backward
passes before it). Sampling runs beside it on each sampler's engine.

A session ends when its client closes it or sends no heartbeat for ``Limits.session_expiry_seconds``
(the SDK sends one every 10 s): its models and samplers are released, and a later heartbeat is told the
session is gone (410).

Each client may train several LoRA adapters on the shared base model (one copy of its tensors for every
adapter and sampler); a full-parameter model (no ``lora_config``) holds a copy of the whole model with
twice as much optimizer state, so it has the server to itself: it is refused while any other model
exists, and every other model is refused while it does.

A client may have ``Limits.queued_per_client`` training requests waiting and ``Limits.sampling_per_client``
samples in flight, and use ``Limits.tokens_per_minute`` tokens a minute (:mod:`.budget`); beyond that it
is told when to retry (429 with Retry-After, which the SDK does by itself). At most
``Limits.samplers`` samplers live at once: creating one more stops the least recently used, and its
client's next sample says it was evicted and how to get it back (save the weights again). Training
states (``save_state``) outlive sessions in a checkpoint store (:mod:`.states`); a model's id is
``SESSION:train:SEQ``, as the SDK derives it when it creates a model from a state.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..inference.engine import max_model_len
from ..models.lora import AdapterError
from .budget import TokenBudget
from .checkpoints import SAMPLER_WEIGHTS, WEIGHTS, Checkpoint, NamedWeights, Snapshot, listing, parse
from .errors import Busy, ClientError, NotFound
from .futures import SERVER, USER, FutureTable, Outcome
from .metrics import TinkerMetrics
from .sampler import SampleParams, Sampler
from .sessions import SessionTable
from .states import SCHEME, UNTIL_DELETED, Keeping, StateStore, TrainingState, state_path
from .trainee import AdapterShape, Trainee
from .wire import ForwardBackwardCall, encode_forward_backward_output, encode_sample_response

log = logging.getLogger(__name__)
Work = Callable[[], Awaitable[Outcome]]  # a piece of training work: its heavy part in a thread


@dataclass(frozen=True)
class ServedModel:
    """The base model this server trains and samples: its name as clients give it, and the module."""

    name: str
    module: torch.nn.Module
    eos_id: int
    pad_id: int
    decode: Callable[[list[int]], str]
    tokenizer_id: str | None = None

    @property
    def max_context(self) -> int:
        return max_model_len(self.module)


@dataclass(frozen=True)
class Limits:
    models_per_client: int = 4
    samplers: int = 8  # live samplers over all clients
    snapshots_per_model: int = 16  # named saves kept per training model (oldest dropped)
    queued_per_client: int = 256  # training requests waiting; one more is told to retry (429, which the SDK does)
    sampling_per_client: int = 1024  # samples in flight
    session_expiry_seconds: float = 300.0  # a session with no heartbeat for this long is finished (the SDK: every 10 s)
    tokens_per_minute: int | None = None  # each client's token rate (:mod:`.budget`); None: no limit


@dataclass
class _Model:
    owner: str
    session: str
    trainee: Trainee
    snapshots: NamedWeights


@dataclass
class _SamplerEntry:
    owner: str
    session: str
    sampler: Sampler


class TinkerService:
    def __init__(self, served: ServedModel, futures: FutureTable | None = None, limits: Limits | None = None,
                 seed: int = 0, states: StateStore | None = None, clock: Callable[[], float] = time.monotonic):
        self.served, self.futures, self.limits = served, futures or FutureTable(), limits or Limits()
        self.states, self.clock, self.metrics = states, clock, TinkerMetrics()
        self.sessions = SessionTable(self.limits.session_expiry_seconds, clock)
        self.budget = TokenBudget(self.limits.tokens_per_minute, clock) if self.limits.tokens_per_minute else None
        self.models: dict[str, _Model] = {}
        self.samplers: collections.OrderedDict[str, _SamplerEntry] = collections.OrderedDict()  # LRU first
        self.evicted: dict[str, str] = {}  # sampler id → owner
        self._work: dict[str, collections.deque[tuple[str, Work]]] = {}
        self._ready = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._sampler_seeds = itertools.count(seed + 1)
        self._adapter_seeds = itertools.count(seed)  # an adapter whose lora_config names no seed: the next
        self._sampling_by: dict[str, int] = {}  # client → samples in flight
        self._sampling: set[asyncio.Task[None]] = set()  # running samples (the loop keeps only weak references)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._worker = loop.create_task(self._run_work(), name="tinker-training")
        self._reaper = loop.create_task(self._reap_forever(), name="tinker-sessions")

    async def stop(self) -> None:
        for task in (self._worker, self._reaper):
            if task is not None:
                task.cancel()
        for entry in self.samplers.values():
            await entry.sampler.stop()

    # -- sessions ----------------------------------------------------------------------------------
    def create_session(self, owner: str) -> str:
        self.metrics.sessions.labels(owner).inc()
        return self.sessions.open(owner)

    def check_session(self, owner: str, session_id: str) -> None:
        self.sessions.check(owner, session_id)

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.sessions.heard(owner, session_id)

    async def finish_session(self, owner: str, session_id: str) -> None:
        """The session ends: its training models, their saved weights and its samplers are released."""
        self.sessions.end(owner, session_id)
        self.metrics.sessions.labels(owner).dec()
        for model_id in [m for m, model in self.models.items() if model.session == session_id]:
            del self.models[model_id]
            self.metrics.models.labels(owner).dec()
        for sampler_id in [s for s, entry in self.samplers.items() if entry.session == session_id]:
            await self.samplers.pop(sampler_id).sampler.stop()
            self.metrics.samplers.labels(owner).dec()

    async def reap(self) -> list[str]:
        """Finish every session not heard from for ``session_expiry_seconds``; their ids."""
        expired = self.sessions.expired()
        for owner, session_id in expired:
            log.info("session %s expired: no heartbeat for %.0f s", session_id, self.limits.session_expiry_seconds)
            await self.finish_session(owner, session_id)
        return [session_id for _, session_id in expired]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.limits.session_expiry_seconds / 10)
            await self.reap()

    # -- training ----------------------------------------------------------------------------------
    def _model(self, owner: str, model_id: str) -> _Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFound(f"model {model_id!r} is not one of yours (create it first)")
        return model

    def check_base(self, base_model: str) -> None:
        if base_model != self.served.name:
            raise ClientError(f"base_model {base_model!r} is not served here; this server serves "
                              f"{self.served.name!r} (get_server_capabilities lists it)")

    def _check_new_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str,
                         adapter: AdapterShape | None) -> str:
        """The new model's id (``SESSION:train:SEQ``, as the SDK derives it), or ClientError saying why not."""
        self.check_session(owner, session_id)
        self.check_base(base_model)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ClientError(f"model_seq_id {model_seq_id}: this session already has that model")
        if sum(m.owner == owner for m in self.models.values()) >= self.limits.models_per_client:
            raise ClientError(f"you have {self.limits.models_per_client} training models, the most a client "
                              "may hold here")
        full = [m for m in self.models.values() if m.trainee.adapter is None]
        if full or (adapter is None and self.models):
            raise ClientError("a full-parameter model (no lora_config) holds a whole copy of the model and its "
                              "optimizer state, so it needs the server to itself: "
                              + ("one is training now" if full else f"{len(self.models)} other models exist"))
        return model_id

    def create_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str,
                     adapter: AdapterShape | None) -> str:
        model_id = self._check_new_model(owner, session_id, model_seq_id, base_model, adapter)

        async def build() -> Outcome:
            try:
                trainee = await asyncio.to_thread(Trainee, self.served.module, adapter, self.served.pad_id,
                                                  next(self._adapter_seeds))
            except AdapterError as err:
                return Outcome(error=f"lora_config: {err}")
            self._add_model(model_id, owner, session_id, trainee)
            return Outcome(json={"model_id": model_id, "type": "create_model"})

        return self._submit(owner, build)

    def _add_model(self, model_id: str, owner: str, session_id: str, trainee: Trainee) -> None:
        if session_id not in self.sessions.owners:  # the session ended while the model was being made
            raise ClientError(f"session {session_id!r} finished before its model was made")
        self.models[model_id] = _Model(owner, session_id, trainee, NamedWeights(self.limits.snapshots_per_model))
        self.metrics.models.labels(owner).inc()

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self._model(owner, model_id)
        adapter = model.trainee.adapter
        return {"type": "get_info", "model_id": model_id, "model_name": self.served.name,
                "is_lora": adapter is not None, "lora_rank": adapter.rank if adapter else None,
                "model_data": {"arch": type(self.served.module).__name__, "model_name": self.served.name,
                               "tokenizer_id": self.served.tokenizer_id}}

    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> str:
        model, tokens = self._model(owner, call.model_id), sum(len(d.tokens) for d in call.data)

        async def run() -> Outcome:
            outputs, metrics = await asyncio.to_thread(model.trainee.forward_backward, call)
            self.metrics.tokens.labels(owner, "trained").inc(tokens)
            return Outcome(proto=encode_forward_backward_output(outputs, metrics))

        return self._submit(owner, run, tokens)

    def optim_step(self, owner: str, model_id: str, adam: dict[str, float]) -> str:
        model = self._model(owner, model_id)

        async def step() -> Outcome:
            metrics = await asyncio.to_thread(lambda: model.trainee.optim_step(**adam))
            return Outcome(json={"type": "optim_step", "metrics": metrics})

        return self._submit(owner, step)

    def save_for_sampler(self, owner: str, model_id: str, name: str | None, session_seq: int | None,
                         keeping: Keeping = UNTIL_DELETED) -> str:
        """A snapshot of the model's weights: under ``tinker://MODEL/sampler_weights/NAME`` when named (kept as
        ``keeping`` says, at most while the model lives), else served at once by a new sampler (the SDK's
        ``save_weights_and_get_sampling_client``)."""
        model = self._model(owner, model_id)

        async def save() -> Outcome:
            weights = await asyncio.to_thread(model.trainee.weights)
            if name is None:
                sampler_id = await self._new_sampler(owner, model.session, model.trainee.adapter, weights, None)
                return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampler_id})
            path = f"{SCHEME}{model_id}/{SAMPLER_WEIGHTS}/{name}"
            model.snapshots.keep(path, Snapshot(weights, time.time(), keeping))
            return Outcome(json={"type": "save_weights_for_sampler", "path": path})

        del session_seq  # the SDK numbers its sampling sessions; ids here are unique on their own
        return self._submit(owner, save)

    def _states(self) -> StateStore:
        if self.states is None:
            raise ClientError("this server keeps no training states (it was started without a checkpoint store)")
        return self.states

    def save_state(self, owner: str, model_id: str, name: str, overwrite: bool,
                   keeping: Keeping = UNTIL_DELETED) -> str:
        model, states = self._model(owner, model_id), self._states()
        path = state_path(model_id, name)

        def write() -> None:
            trainee = model.trainee
            states.save(owner, path, TrainingState(self.served.name, trainee.adapter, trainee.weights(),
                                                   trainee.optimizer_state(), trainee.steps), overwrite, keeping)

        async def save() -> Outcome:
            await asyncio.to_thread(write)
            return Outcome(json={"type": "save_weights", "path": path})

        return self._submit(owner, save)

    def load_state(self, owner: str, model_id: str, path: str, with_optimizer: bool) -> str:
        """Into an existing model (same adapter shape): its weights and, with ``with_optimizer``, its optimizer."""
        model, states = self._model(owner, model_id), self._states()

        async def load() -> Outcome:
            state = await asyncio.to_thread(states.load, owner, path)
            if not AdapterShape.same(state.adapter, model.trainee.adapter):
                raise ClientError(f"path {path!r} holds a model with adapter {state.adapter}, this one has "
                                  f"{model.trainee.adapter}")
            await asyncio.to_thread(model.trainee.restore, state.weights, state.optimizer if with_optimizer else None,
                                    state.steps)
            return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

        return self._submit(owner, load)

    # -- checkpoints, as the SDK's RestClient sees them (:mod:`.checkpoints`) ---------------------------------
    async def checkpoints(self, owner: str, model_id: str) -> list[Checkpoint]:
        """``owner``'s checkpoints of ``model_id``: its training states (they outlive the model) and, while the
        model lives, its named sampler weights; NotFound when there are neither."""
        model = self.models.get(model_id)
        live = model if model is not None and model.owner == owner else None
        states = await asyncio.to_thread(self.states.saved, owner, model_id) if self.states else []
        if live is None and not states:
            raise NotFound(f"training run {model_id!r}: none of yours (no live model and no saved state)")
        return listing(states, live.snapshots if live else None)

    async def set_checkpoint_ttl(self, owner: str, path: str, ttl_seconds: int | None) -> None:
        """Keep a state or named sampler weights ``ttl_seconds`` from now (None: as long as they would be)."""
        model_id, kind = parse(path)
        if kind == WEIGHTS:
            await asyncio.to_thread(self._states().set_ttl, owner, path, ttl_seconds)
        else:
            self._model(owner, model_id).snapshots.retime(path, ttl_seconds)

    async def weights_info(self, owner: str, path: str) -> tuple[str, AdapterShape | None]:
        """The base model and adapter shape of a saved state or a live model's named sampler weights."""
        model_id, kind = parse(path)
        if kind == WEIGHTS:
            return await asyncio.to_thread(self._states().describe, owner, path)
        model = self._model(owner, model_id)
        model.snapshots.get(path)
        return self.served.name, model.trainee.adapter

    async def delete_checkpoint(self, owner: str, path: str) -> None:
        """A training state from the store, or a live model's named sampler weights (samplers already serving
        them keep serving)."""
        model_id, kind = parse(path)
        if kind == WEIGHTS:
            await asyncio.to_thread(self._states().delete, owner, path)
        else:
            self._model(owner, model_id).snapshots.delete(path)

    def create_from_state(self, owner: str, session_id: str, model_seq_id: int, path: str,
                          with_optimizer: bool, base_model: str | None = None) -> str:
        """A new model made from a saved state: its adapter shape, weights and (``with_optimizer``) optimizer;
        ``base_model``: the base the client expects the state to be on."""
        states = self._states()
        self.check_session(owner, session_id)

        async def create() -> Outcome:
            state = await asyncio.to_thread(states.load, owner, path)
            if base_model is not None and base_model != state.base_model:
                raise ClientError(f"base_model {base_model!r}: the state at {path!r} is on {state.base_model!r}")
            model_id = self._check_new_model(owner, session_id, model_seq_id, state.base_model, state.adapter)
            trainee = await asyncio.to_thread(Trainee, self.served.module, state.adapter, self.served.pad_id)
            await asyncio.to_thread(trainee.restore, state.weights, state.optimizer if with_optimizer else None,
                                    state.steps)
            self._add_model(model_id, owner, session_id, trainee)
            return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

        return self._submit(owner, create)

    # -- sampling ----------------------------------------------------------------------------------
    async def _new_sampler(self, owner: str, session: str, adapter: AdapterShape | None,
                           weights: dict[str, torch.Tensor] | None, path: str | None) -> str:
        kwargs: dict[str, Any] = {"eos_id": self.served.eos_id, "pad_id": self.served.pad_id,
                                  "decode": self.served.decode, "seed": next(self._sampler_seeds),
                                  "base_model": self.served.name, "model_path": path}
        sampler = (Sampler(self.served.module, **kwargs) if weights is None
                   else await asyncio.to_thread(Sampler.of_weights, self.served.module, adapter, weights, **kwargs))
        sampler.start()
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.samplers[sampler_id] = _SamplerEntry(owner, session, sampler)
        self.metrics.samplers.labels(owner).inc()
        while len(self.samplers) > self.limits.samplers:
            old_id, old = self.samplers.popitem(last=False)
            self.evicted[old_id] = old.owner
            self.metrics.samplers.labels(old.owner).dec()
            await old.sampler.stop()
            log.info("sampler %s evicted (at most %d live)", old_id, self.limits.samplers)
        return sampler_id

    async def create_sampling_session(self, owner: str, session_id: str, base_model: str | None,
                                      model_path: str | None) -> str:
        self.check_session(owner, session_id)
        if model_path is None:
            self.check_base(base_model or "")
            return await self._new_sampler(owner, session_id, None, None, None)
        model_id, _ = parse(model_path, "model_path")
        model = self._model(owner, model_id)
        snapshot = model.snapshots.get(model_path)
        return await self._new_sampler(owner, session_id, model.trainee.adapter, snapshot.weights, model_path)

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        if self.evicted.get(sampler_id) == owner:
            raise ClientError(f"sampler {sampler_id!r} was evicted ({self.limits.samplers} samplers live at "
                              "most on this server); save the weights again for a new one")
        entry = self.samplers.get(sampler_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"sampler {sampler_id!r} is not one of yours")
        self.samplers.move_to_end(sampler_id)
        return entry.sampler

    def sample(self, owner: str, sampler_id: str, prompt: list[int], n: int, params: SampleParams,
               with_prompt_logprobs: bool) -> str:
        sampler = self.sampler(owner, sampler_id)
        sampler.check_prompt(prompt)
        if self._sampling_by.get(owner, 0) >= self.limits.sampling_per_client:
            raise Busy(f"{self.limits.sampling_per_client} samples of yours are in flight, the most a client may have "
                       "here; retry when some are done")
        room = sampler.max_len - len(prompt)  # ≥ 1: check_prompt refused a prompt that fills the context
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens or room, room))
        reserved = n * params.max_tokens
        self._spend(owner, len(prompt) + reserved)
        self._sampling_by[owner] = self._sampling_by.get(owner, 0) + 1
        request_id = self.futures.open(owner)

        async def run() -> None:
            sampled = 0
            try:
                sequences = await sampler.sample(prompt, n, params)
                sampled = sum(len(s.tokens) for s in sequences)
                self.metrics.tokens.labels(owner, "sampled").inc(sampled)
                prompt_logprobs = await sampler.prompt_logprobs(prompt) if with_prompt_logprobs else None
                outcome = Outcome(proto=encode_sample_response(sequences, prompt_logprobs))
            except Exception as err:  # the client gets it as the future's failure; the log keeps the trace
                log.exception("sample %s failed", request_id)
                outcome = Outcome(error=f"sampling failed: {err}", category=SERVER)
            self._sampling_by[owner] -= 1
            if self.budget is not None:
                self.budget.give_back(owner, reserved - sampled)  # the tokens not generated
            self._finish(owner, request_id, outcome)

        task = asyncio.get_running_loop().create_task(run())
        self._sampling.add(task)
        task.add_done_callback(self._sampling.discard)
        return request_id

    def _spend(self, owner: str, tokens: int) -> None:
        if self.budget is not None:
            self.budget.take(owner, tokens)

    # -- the training worker -----------------------------------------------------------------------
    def _submit(self, owner: str, work: Work, tokens: int = 0) -> str:
        """Queue ``work`` (costing ``tokens`` of the client's budget) for the worker; its future's id."""
        if len(self._work.get(owner, ())) >= self.limits.queued_per_client:
            raise Busy(f"{self.limits.queued_per_client} training requests of yours are waiting, the most a client may "
                       "queue here; retry when some are done")
        self._spend(owner, tokens)
        request_id = self.futures.open(owner)
        self._work.setdefault(owner, collections.deque()).append((request_id, work))
        self.metrics.queued.labels(owner).inc()
        self._ready.set()
        return request_id

    def _finish(self, owner: str, request_id: str, outcome: Outcome) -> None:
        if outcome.error is not None:
            self.metrics.failures.labels(owner, outcome.category).inc()
        self.futures.finish(request_id, outcome)

    def _next_work(self) -> tuple[str, str, Work] | None:
        """The next piece of work (client, request, work), round-robin over clients: the first client with work
        goes to the back."""
        for owner in list(self._work):
            queue = self._work.pop(owner)
            if queue:
                request_id, work = queue.popleft()
                if queue:
                    self._work[owner] = queue
                self.metrics.queued.labels(owner).dec()
                return owner, request_id, work
        return None

    async def _run_work(self) -> None:
        while True:
            item = self._next_work()
            if item is None:
                self._ready.clear()
                await self._ready.wait()
                continue
            owner, request_id, work = item
            try:
                outcome = await work()
            except ClientError as err:
                outcome = Outcome(error=str(err), category=USER)
            except Exception as err:  # the client gets it as the future's failure; the log keeps the trace
                log.exception("request %s failed", request_id)
                outcome = Outcome(error=f"{type(err).__name__}: {err}", category=SERVER)
            self._finish(owner, request_id, outcome)
