"""Worker processes for the multi-process tests (gloo worlds of trainer ranks and replicas), forked
from one server process per test process that has imported torch, transformers and megatron-core
once.

A new interpreter that imports them takes 6–9 CPU-seconds on this project's 2-core CI machine, more
than most of these tests' work; the suite starts ~40 such processes. ``multiprocessing``'s fork
server (``forkserver``) imports the modules below once, while it is still single-threaded, and forks
each worker from that state. Each worker is still its own process with its own gloo sockets; what
it shares with its siblings is the copy-on-write image of imported code.

A forked worker inherits the fork server's environment and working directory, not the test's:
:func:`start_workers` hands it the test's ``os.environ`` and cwd at the call, as a spawned
process would have them."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from kuberl.local.processes import free_port

PRELOADED = [
    "torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing", "megatron.core.transformer.moe",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.llama.modeling_llama", "hypothesis",
    "kuberl.fsdp.actor", "kuberl.megatron.actor", "kuberl.weights.transport", "kuberl.checkpoint",
    "tests.workers",
]  # fmt: skip  (a module that is not installed is left out by the fork server)


def _in_callers_env(rank: int, env: dict[str, str], cwd: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)


class _FreePort:
    """The type of :data:`FREE_PORT`."""


FREE_PORT = _FreePort()
"""An argument :func:`start_workers` replaces with a fresh :func:`~kuberl.local.processes.free_port`
on each attempt."""


def start_workers(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), attempts: int = 3) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the fork server, with the caller's env
    and cwd; returns when all have exited, raises as ``torch.multiprocessing.start_processes`` does
    when one fails. Each :data:`FREE_PORT` in ``args`` is a port nobody listened on when chosen;
    another process may still bind it before the worker does (seen in CI: EADDRINUSE when rank 0
    opened its store), so the workers start again on new ports then, up to ``attempts`` times."""
    multiprocessing.set_forkserver_preload(PRELOADED)  # read once, when this process's server starts
    for attempt in range(1, attempts + 1):
        chosen = tuple(free_port() if a is FREE_PORT else a for a in args)
        try:
            mp.start_processes(_in_callers_env, args=(dict(os.environ), os.getcwd(), fn, chosen), nprocs=nprocs,
                               start_method="forkserver")
            return
        except mp.ProcessRaisedException as err:
            if "EADDRINUSE" not in str(err) or attempt == attempts:
                raise
