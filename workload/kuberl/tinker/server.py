"""The Tinker-compatible HTTP API: ``tinker.ServiceClient(base_url=…, api_key=…)`` works against it unmodified.

Routes (all under ``/api/v1``; every one but ``healthz`` needs a client's key in ``X-API-Key``)::

    GET  healthz, get_server_capabilities, samplers/{id}; and /metrics (Prometheus, per client: :mod:`.metrics`)
    POST client/config, client/dynamic_config   the SDK's feature flags: the ones this server serves
    POST create_session, session_heartbeat, sessions/{id}/finish, telemetry (accepted, not kept)
    POST create_model, get_info, forward_backward (protocol buffers), optim_step,
         save_weights (save_state), load_weights (load_state, create from a state),
         save_weights_for_sampler, create_sampling_session, asample
    POST retrieve_future                       long work's result: JSON, protocol buffers, or "try again"
    GET  training_runs/{model}/checkpoints      a model's saved states and named sampler weights (RestClient)
    POST weights_info                           a checkpoint's base model and adapter shape (RestClient)
    DELETE training_runs/{model}/checkpoints/{weights/NAME | sampler_weights/NAME}; PUT …/{ID}/ttl (TTL from now)

Work that takes long (everything a model or sampler does) answers with a future at once; the client
polls ``retrieve_future``. A bad request is a 400 whose ``error`` names the field, another client's
model, sampler or future a 404, as if it did not exist; a finished session a 410; a client over its share
of queued work a 429 (the SDK retries); an unknown key a 401.
Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from ..auth import Handler
from ..jsonbody import read_json
from . import schema
from .errors import Busy, ClientError, Gone, NotFound
from .futures import FutureTable
from .service import TinkerService
from .states import SCHEME
from .wire import WireError, decode_forward_backward

KEY_HEADER = "X-API-Key"
PREFIX = "/api/v1"
CHECKPOINTS = "training_runs/{model_id}/checkpoints"  # the SDK's RestClient: list (GET) and delete (DELETE …/ID)
OPEN_PATHS = {f"{PREFIX}/healthz", "/metrics"}
MAX_PROTO_BYTES = 16 * 2**20
CHUNK_BYTES = 4 * 2**20  # the most a forward/backward request of the SDK carries (it splits larger batches)
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": False,  # a model's chunks arrive in order; the server runs them as they come
    "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_bytes_count": CHUNK_BYTES,
    "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False,
}
OWNER = web.RequestKey("owner", str)


def owner_of(key: str | None, keys: Mapping[str, str]) -> str | None:
    """The client whose key ``key`` is (``keys``: key → client name), each compared in constant time."""
    presented = (key or "").encode("utf-8", "replace")
    found = None
    for candidate, name in keys.items():
        if hmac.compare_digest(presented, candidate.encode()):
            found = name
    return found


def _checkpoint_path(request: web.Request) -> str:
    """``tinker://MODEL/CHECKPOINT_ID`` of a ``training_runs/{model_id}/checkpoints/{checkpoint_id}`` route."""
    return f"{SCHEME}{request.match_info['model_id']}/{request.match_info['checkpoint_id']}"


def _iso(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, UTC).isoformat()


def _error(status: type[web.HTTPException], message: str, **headers: str) -> web.HTTPException:
    """The SDK reads a failed request's reason from ``error`` (and ``detail``)."""
    return status(text=json.dumps({"error": message, "detail": message}), content_type="application/json",
                  headers=headers or None)


class TinkerApi:
    def __init__(self, service: TinkerService, keys: Mapping[str, str]):
        self.service, self.keys = service, dict(keys)

    @property
    def futures(self) -> FutureTable:
        return self.service.futures

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_PROTO_BYTES, middlewares=[self._authenticate, self._errors])
        get, post = {"healthz": self.healthz, "get_server_capabilities": self.capabilities,
                     "samplers/{sampler_id}": self.sampler_info}, {
            "client/config": self.client_config, "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session, "session_heartbeat": self.heartbeat,
            "sessions/{session_id}/finish": self.finish_session, "telemetry": self.telemetry,
            "create_model": self.create_model, "get_info": self.get_info, "forward_backward": self.forward_backward,
            "optim_step": self.optim_step, "save_weights_for_sampler": self.save_for_sampler,
            "save_weights": self.save_state, "load_weights": self.load_state,
            "create_sampling_session": self.create_sampling_session, "asample": self.sample,
            "retrieve_future": self.retrieve_future, "weights_info": self.weights_info}
        get[CHECKPOINTS] = self.list_checkpoints
        app.add_routes([web.get(f"{PREFIX}/{path}", handler) for path, handler in get.items()]
                       + [web.post(f"{PREFIX}/{path}", handler) for path, handler in post.items()]
                       + [web.delete(f"{PREFIX}/{CHECKPOINTS}/{{checkpoint_id:.+}}", self.delete_checkpoint),
                          web.put(f"{PREFIX}/{CHECKPOINTS}/{{checkpoint_id:.+}}/ttl", self.set_checkpoint_ttl),
                          web.get("/metrics", self.prometheus)])
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            owner = owner_of(request.headers.get(KEY_HEADER), self.keys)
            if owner is None:
                raise _error(web.HTTPUnauthorized, f"a valid API key is required in {KEY_HEADER}")
            request[OWNER] = owner
            route = request.match_info.route.resource
            kind = route.canonical.removeprefix(PREFIX + "/") if route is not None else "unknown"
            self.service.metrics.requests.labels(owner, kind).inc()
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (ClientError, WireError) as err:
            raise _error(web.HTTPBadRequest, str(err)) from err
        except NotFound as err:
            raise _error(web.HTTPNotFound, str(err)) from err
        except Gone as err:
            raise _error(web.HTTPGone, str(err)) from err
        except Busy as err:
            raise _error(web.HTTPTooManyRequests, str(err), **{"Retry-After": str(math.ceil(err.retry_after))}) from err

    # -- service -------------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.service.metrics.registry), content_type="text/plain")

    async def capabilities(self, request: web.Request) -> web.Response:
        served = self.service.served
        return web.json_response({"supported_models": [{"model_name": served.name, "max_context_length":
                                                        served.max_context, "trainable": True, "sampleable": True}]})

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def create_session(self, request: web.Request) -> web.Response:
        await read_json(request)
        return web.json_response({"type": "create_session", "session_id": self.service.create_session(request[OWNER])})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.service.heartbeat(request[OWNER], str(body.get("session_id", "")))
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        await self.service.finish_session(request[OWNER], request.match_info["session_id"])
        return web.json_response({})

    async def telemetry(self, request: web.Request) -> web.Response:
        await read_json(request)
        return web.json_response({"status": "accepted"})

    # -- training ------------------------------------------------------------------------------------
    def _future(self, request_id: str, model_id: str | None = None, **extra: Any) -> web.Response:
        return web.json_response({"request_id": request_id, "model_id": model_id, **extra})

    async def create_model(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.CreateModel, await read_json(request))
        adapter = body.lora_config.shape() if body.lora_config else None
        return self._future(self.service.create_model(request[OWNER], body.session_id, body.model_seq_id,
                                                      body.base_model, adapter))

    async def get_info(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        return web.json_response(self.service.info(request[OWNER], str(body.get("model_id", ""))))

    async def forward_backward(self, request: web.Request) -> web.Response:
        call = decode_forward_backward(await request.read())
        return self._future(self.service.forward_backward(request[OWNER], call), call.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.OptimStep, await read_json(request))
        assert body.adam_params is not None  # the schema refuses a step without them
        request_id = self.service.optim_step(request[OWNER], body.model_id, body.adam_params.step_args())
        return self._future(request_id, body.model_id)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.SaveForSampler, await read_json(request))
        request_id = self.service.save_for_sampler(request[OWNER], body.model_id, body.path,
                                                   body.sampling_session_seq_id, body.keeping)
        return self._future(request_id, body.model_id)

    async def save_state(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.SaveState, await read_json(request))
        request_id = self.service.save_state(request[OWNER], body.model_id, body.path, body.overwrite, body.keeping)
        return self._future(request_id, body.model_id)

    async def load_state(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.LoadState, await read_json(request))
        owner = request[OWNER]
        if body.model_id is not None:
            return self._future(self.service.load_state(owner, body.model_id, body.path, body.optimizer),
                                body.model_id)
        assert body.session_id is not None and body.model_seq_id is not None  # the schema checked
        return self._future(self.service.create_from_state(owner, body.session_id, body.model_seq_id, body.path,
                                                           body.optimizer, body.base_model))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        found = await self.service.checkpoints(request[OWNER], request.match_info["model_id"])
        return web.json_response({"checkpoints": [
            {"checkpoint_id": c.checkpoint_id, "checkpoint_type": c.kind, "tinker_path": c.path,
             "time": _iso(c.saved_at), "size_bytes": c.size_bytes, "user_metadata": c.keeping.user_metadata,
             "expires_at": None if c.keeping.expires_at is None else _iso(c.keeping.expires_at)}
            for c in found], "cursor": None})

    async def weights_info(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.WeightsInfo, await read_json(request))
        base_model, adapter = await self.service.weights_info(request[OWNER], body.tinker_path)
        shape = {} if adapter is None else {"lora_rank": adapter.rank, "train_unembed": adapter.train_unembed,
                                            "train_mlp": adapter.train_mlp, "train_attn": adapter.train_attn}
        return web.json_response({"base_model": base_model, "is_lora": adapter is not None, **shape})

    async def set_checkpoint_ttl(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.SetTtl, await read_json(request))
        await self.service.set_checkpoint_ttl(request[OWNER], _checkpoint_path(request), body.ttl_seconds)
        return web.Response(status=204)

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        await self.service.delete_checkpoint(request[OWNER], _checkpoint_path(request))
        return web.Response(status=204)

    # -- sampling ------------------------------------------------------------------------------------
    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.CreateSamplingSession, await read_json(request))
        sampler_id = await self.service.create_sampling_session(request[OWNER], body.session_id, body.base_model,
                                                                body.model_path)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    async def sampler_info(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        sampler = self.service.sampler(request[OWNER], sampler_id)
        return web.json_response({"sampler_id": sampler_id, "base_model": sampler.base_model,
                                  "model_path": sampler.model_path})

    async def sample(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.Sample, await read_json(request))
        request_id = self.service.sample(request[OWNER], body.sampling_session_id, body.prompt.tokens(),
                                         body.num_samples, body.sampling_params.checked(), bool(body.prompt_logprobs))
        return self._future(request_id, sample_sequence_ids=[f"{request_id}-{i}" for i in range(body.num_samples)])

    # -- futures -------------------------------------------------------------------------------------
    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = schema.parse(schema.FutureRetrieve, await read_json(request))
        try:
            outcome = await self.futures.retrieve(body.request_id, request[OWNER])
        except KeyError:
            raise NotFound(f"request {body.request_id!r} is not one of yours") from None
        if outcome is None:
            return web.json_response({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if outcome.error is not None:
            return web.json_response({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return web.Response(body=outcome.proto, content_type="application/x-protobuf")
        return web.json_response(outcome.json)
