"""``kuberl serve FILE``: the Tinker-compatible API for the model of an RLExperiment manifest, on this machine.

It loads ``spec.model`` (a builtin tiny model, a local or ``s3://`` directory, an ``hf://`` model) once,
serves it to every client whose key is in ``keys`` (key → client name), keeps the clients' training
states under ``spec.checkpoint.uri`` (else a local directory) and runs until interrupted (Ctrl-C) or
terminated (SIGTERM). The
model's name for clients is the hub name of an ``hf://`` model (``Qwen/Qwen3-8B``), else ``spec.model.path``
as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping

import torch
from aiohttp import web

from ..api.spec import Accelerator, ModelSource
from ..checkpoint.store import open_store
from ..devices import accelerator_device, compute_dtype, placed
from ..models.hub import parse_hub_path
from ..models.loading import load_model
from ..settings import Settings
from .futures import FutureTable
from .server import TinkerApi
from .service import Limits, ServedModel, TinkerService
from .states import StateStore

log = logging.getLogger(__name__)


def served_name(source: ModelSource) -> str:
    hub = parse_hub_path(source.path)
    return hub.repo if hub is not None else source.path


def served_model(source: ModelSource, seed: int, settings: Settings,
                 accelerator: Accelerator = Accelerator.CPU) -> ServedModel:
    """``source`` loaded once, frozen, on this machine's first ``accelerator`` (or the CPU) in ``spec.model.dtype``
    (auto: bfloat16 on an accelerator, float32 on the CPU) — the base every adapter and sampler shares."""
    model, tokenizer = load_model(source, seed, settings)
    model = placed(model, accelerator_device(accelerator, 0), compute_dtype(source.dtype, accelerator))
    for param in model.parameters():
        param.requires_grad_(False)
    hub = parse_hub_path(source.tokenizer or source.path)
    return ServedModel(served_name(source), model, int(tokenizer.eos_token_id), int(tokenizer.pad_token_id),
                       lambda ids: tokenizer.decode(ids), hub.repo if hub is not None else None)


async def serve(served: ServedModel, keys: Mapping[str, str], host: str, port: int, seed: int,
                states: StateStore | None, ready: asyncio.Event | None = None, limits: Limits | None = None,
                poll_seconds: float = 20.0) -> None:
    """Serve until cancelled; ``ready`` is set once the port is open."""
    service = TinkerService(served, FutureTable(poll_seconds), limits or Limits(), seed, states)
    service.start()
    runner = web.AppRunner(TinkerApi(service, keys).app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host or "0.0.0.0", port).start()
        log.info("Tinker API for %s on port %d (%d clients)", served.name, port, len(keys))
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await service.stop()
        await runner.cleanup()


def run(source: ModelSource, seed: int, accelerator: Accelerator, keys: Mapping[str, str], host: str, port: int,
        states_uri: str, settings: Settings, limits: Limits | None = None) -> None:
    """Serve ``source`` until interrupted, keeping training states under ``states_uri`` (file:// or s3://)."""
    torch.manual_seed(seed)
    served = served_model(source, seed, settings, accelerator)
    states = StateStore(open_store(states_uri, endpoint=settings.s3_endpoint))

    async def until_stopped() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # as a pod is stopped
        with contextlib.suppress(asyncio.CancelledError):
            await serve(served, keys, host, port, seed, states, limits=limits)

    asyncio.run(until_stopped())
