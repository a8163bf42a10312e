"""The inference HTTP contract (every engine serves exactly this):

    POST /generate        {"input_ids": [...]} or {"prompt": "text"}, "max_new_tokens", "temperature",
                          "top_p", "n", "return_routes"  →  {"version", "outputs": [{"output_ids",
                          "logprobs", "versions", "finish_reason"[, "routes"]}]}
                          (finish_reason: stop | length | abort; routes: kuberl.models.moe_routing)
    POST /pause           abort in-flight requests (they return partial tokens, finish "abort")
    POST /resume
    POST /update_weights  body: safetensors bytes of the full state dict; ?version=N
                          (or ?version=N&path=FILE: read them from disk mode's shared directory)
    GET  /version         {"version": N}
    GET  /topology        {"node", "fabric", "zone"} of this pod (from its labels)
    POST /weights/p2p/join     this replica's part of the p2p plan (kuberl.weights.p2p)
    POST /weights/p2p/receive  ?version=N: receive it from the trainer ranks, swap it in
    GET  /health          200 when ready; 503 once the engine stopped or hangs with work waiting
    GET  /metrics         Prometheus text format

Every route but the read-only ``OPEN_PATHS`` needs the experiment's API token (``kuberl.auth``);
JSON bodies are capped at ``MAX_JSON_BYTES`` (the weights upload is not JSON and not capped).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from ..api.base import shown
from ..auth import require_token
from ..jsonbody import bad_request, read_json
from ..models.text import TextCodec
from ..settings import Settings
from ..weights.discovery import own_topology, to_json
from .contract import MAX_PROMPT_TOKENS, Engine, EngineDown, GenerateReply, SamplingParams
from .faults import injected_faults
from .p2p_receiver import NotJoined, P2PReceiver

log = logging.getLogger("kuberl.inference")
tracer = trace.get_tracer("kuberl.inference")  # a no-op until kuberl.tracing.set_up installs a provider


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kuberl_inference_requests", "generate requests", registry=self.registry)
        self.tokens = Gauge("kuberl_inference_generated_tokens", "tokens generated", registry=self.registry)
        self.aborted = Gauge("kuberl_inference_aborted_requests", "requests aborted by pause", registry=self.registry)
        self.version = Gauge("kuberl_inference_weight_version", "current weight version", registry=self.registry)
        self.in_flight = Gauge("kuberl_inference_in_flight", "queued + running requests", registry=self.registry)
        self.weight_updates = Counter("kuberl_inference_weight_updates", "weight updates", registry=self.registry)


MAX_SAMPLES = 64  # "n" per request
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/topology"})
MAX_NEW_TOKENS = 32768


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key}: expected an integer in [{low}, {high}], got {shown(value)}")
    return value


def _float(body: dict[str, Any], key: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            low < value <= high if open_low else low <= value <= high):
        bound = "(" if open_low else "["
        raise ValueError(f"{key}: expected a number in {bound}{low}, {high}], got {shown(value)}")
    return float(value)


def parse_generate(body: Any, vocab_size: int, tokenizer: Any | None,
                   max_model_len: int = 2**31 - 1) -> tuple[list[int], SamplingParams, int]:
    """A /generate body → (prompt ids, sampling params, n); ValueError naming the field otherwise.
    Token ids must be in [0, vocab_size): anything else would crash the engine's forward pass. The
    prompt must leave room for one new token in the engine's context (``max_model_len``); generation
    ends there (finish_reason length) whatever ``max_new_tokens`` asks."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if "input_ids" in body:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_TOKENS or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise ValueError(f"input_ids: expected 1 to {MAX_PROMPT_TOKENS} token ids in [0, {vocab_size})")
    elif isinstance(body.get("prompt"), str) and tokenizer is not None:
        if len(body["prompt"]) > 4 * MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt: longer than {4 * MAX_PROMPT_TOKENS} characters")
        ids = TextCodec(tokenizer).encode_prompt(body["prompt"])
        if not ids:
            raise ValueError("prompt: encodes to no tokens")
    else:
        raise ValueError("give input_ids (a list of token ids) or prompt (text)")
    if len(ids) >= max_model_len:
        field = "input_ids" if "input_ids" in body else "prompt"
        raise ValueError(f"{field}: {len(ids)} tokens leave no room in this model's context of {max_model_len}")
    params = SamplingParams(
        max_new_tokens=_int(body, "max_new_tokens", 64, 1, MAX_NEW_TOKENS),
        temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        return_routes=_bool(body, "return_routes"),
    )
    return ids, params, _int(body, "n", 1, 1, MAX_SAMPLES)


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false")
    return value


def weights_file(path: str, directory: Path | None) -> Path:
    """The file ``/update_weights?path=`` names, if it lies in disk mode's shared ``directory`` (after
    resolving links); ValueError otherwise — a replica reads no other file of its pod on request."""
    if directory is None:
        raise ValueError("path=: this replica takes weights by file only in weightSync.mode disk")
    resolved, root = Path(path).resolve(), directory.resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"path={path!r}: not in the shared weights directory {str(root)!r}")
    if not resolved.is_file():
        raise ValueError(f"path={path!r}: no such file here (disk mode needs a volume shared with the trainer)")
    return resolved


class Replica:
    """The HTTP contract above over one ``engine``: a handler per route (``routes``), the metrics they
    keep, the p2p receiver and the start/stop hooks. ``token``: the experiment's API token;
    ``weights_dir``: disk mode's shared directory, the only place ``/update_weights?path=`` may read
    from (None: no file updates); ``settings``: this pod's (the p2p exchange's address, its place)."""

    def __init__(self, engine: Engine, tokenizer: Any | None, weights_dir: Path | None, settings: Settings):
        self.engine, self.tokenizer, self.weights_dir, self.settings = engine, tokenizer, weights_dir, settings
        self.metrics = Metrics()
        self.receiver = P2PReceiver(engine, settings)
        self.faults = injected_faults(settings.fault_injection)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/generate", self.generate), web.post("/pause", self.pause),
                web.post("/resume", self.resume), web.post("/update_weights", self.update_weights),
                web.get("/version", self.version), web.get("/topology", self.topology),
                web.post("/weights/p2p/join", self.p2p_join), web.post("/weights/p2p/receive", self.p2p_receive),
                web.get("/health", self.health), web.get("/metrics", self.prometheus)]

    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        engine = self.engine
        try:
            ids, params, n = parse_generate(body, engine.vocab_size, self.tokenizer, engine.max_model_len)
        except ValueError as err:
            raise bad_request(str(err)) from err
        self.metrics.requests.inc()
        with tracer.start_as_current_span("engine", context=propagate.extract(request.headers),
                                          kind=trace.SpanKind.SERVER) as span:  # in the sample's trace
            try:
                outs = await asyncio.gather(*(engine.generate(ids, params) for _ in range(n)))
            except EngineDown as err:
                raise web.HTTPServiceUnavailable(text=str(err)) from err
            span.set_attributes({"kuberl.version": engine.version, "kuberl.samples": n,
                                 "kuberl.output_tokens": sum(len(o.output_ids) for o in outs)})
        return web.json_response(GenerateReply(engine.version, list(outs)).to_json())

    async def pause(self, request: web.Request) -> web.Response:
        return web.json_response({"aborted": await self.engine.pause(), "version": self.engine.version})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"version": self.engine.version})

    async def update_weights(self, request: web.Request) -> web.Response:
        version = _version_query(request)
        path = request.query.get("path")
        try:
            file = weights_file(path, self.weights_dir) if path is not None else None
        except ValueError as err:
            raise bad_request(str(err)) from err
        state = load_file(file) if file is not None else load_safetensors(await request.read())
        try:
            await self.engine.load_weights(state, version)
        except ValueError as err:
            raise bad_request(str(err)) from err
        self.metrics.weight_updates.inc()
        log.info("loaded weights version %d (%d tensors)", version, len(state))
        return web.json_response({"version": self.engine.version})

    async def topology(self, request: web.Request) -> web.Response:
        return web.json_response(to_json(own_topology(self.settings.podinfo_labels, self.settings.node_name)))

    async def p2p_join(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        try:
            self.receiver.join(body)
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise bad_request(f"bad p2p join request: {err}") from err
        return web.json_response({"status": "joining"})

    async def p2p_receive(self, request: web.Request) -> web.Response:
        version = _version_query(request)
        try:
            seconds = await self.receiver.receive(version)
        except NotJoined as err:
            raise web.HTTPConflict(text=str(err)) from err
        self.metrics.weight_updates.inc()
        log.info("received weights version %d over p2p in %.3f s", version, seconds)
        return web.json_response({"version": self.engine.version, "seconds": seconds})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.engine.version, "paused": self.engine.paused})

    async def health(self, request: web.Request) -> web.Response:
        problem, engine = self.engine.health(), self.engine
        reply = {"status": problem or "ok", "version": engine.version, "inFlight": engine.in_flight}
        return web.json_response(reply, status=503 if problem is not None else 200)

    async def prometheus(self, request: web.Request) -> web.Response:
        metrics, engine = self.metrics, self.engine
        metrics.tokens.set(engine.generated_tokens)
        metrics.aborted.set(engine.aborted)
        metrics.version.set(engine.version)
        metrics.in_flight.set(engine.in_flight)
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain")

    async def on_startup(self, app: web.Application) -> None:
        self.engine.start()
        if self.faults is not None:
            self.faults.install(asyncio.get_running_loop())

    async def on_cleanup(self, app: web.Application) -> None:
        await self.engine.stop()


def _version_query(request: web.Request) -> int:
    try:
        return int(request.query["version"])
    except (KeyError, ValueError) as err:
        raise bad_request("query parameter version=N is required") from err


def build_app(engine: Engine, tokenizer: Any | None, token: str, weights_dir: Path | None = None,
              settings: Settings | None = None) -> web.Application:
    """The replica's aiohttp application (``Replica``) behind the token check (``OPEN_PATHS`` open) and
    the injected faults, if any; ``settings`` default: a bare process next to trainer rank 0."""
    replica = Replica(engine, tokenizer, weights_dir, settings or Settings())
    faults = [replica.faults.middleware] if replica.faults else []
    app = web.Application(client_max_size=2**34, middlewares=[require_token(token, OPEN_PATHS), *faults])
    app.router.add_routes(replica.routes())
    app.on_startup.append(replica.on_startup)
    app.on_cleanup.append(replica.on_cleanup)
    return app
