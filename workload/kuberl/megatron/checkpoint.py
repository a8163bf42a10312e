"""Megatron checkpoints through ``megatron.core.dist_checkpointing``: each rank saves its pieces as
``ShardedTensor``s — a whole-model key (global layer and expert numbers) and the piece's place in
the whole tensor — so a checkpoint written by one tensor / pipeline / expert / data layout loads
into any other (each rank reads the slices its new pieces cover).

Saved: the model; AdamW's moments (``exp_avg``, ``exp_avg_sq``) sharded exactly as their
parameters (``optim_state_to_sharding_state``) and its step count, which is the same for every
parameter, once; with a KL term the frozen π_ref under ``reference.``. Every parameter has its AdamW
state before a save or a load (zero moments at step 0 — what AdamW's first step would create), so
the two sides describe the same tensors.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _with_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state if it has none yet: step 0, zero moments."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}  # fmt: skip


def _common_step(optimizer_state: dict[str, Any]) -> float:
    steps = {float(state["step"]) for state in optimizer_state["state"].values()}
    if len(steps) != 1:
        raise ValueError(f"AdamW's step differs between parameters ({sorted(steps)}): cannot checkpoint it once")
    return steps.pop()


def sharded_state(model: Any, optimizer: torch.optim.Optimizer, reference: Any | None) -> dict[str, Any]:
    """What ``dist_checkpointing`` saves and loads for this rank (every rank calls it)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    _with_adam_state(optimizer)
    model_state = model.sharded_state_dict()
    optimizer_state = optimizer.state_dict()
    step = _common_step(optimizer_state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state_to_sharding_state(optimizer_state, get_param_id_to_sharded_param_map(model_state, params),
                                  exclude_keys=("step",))  # fmt: skip
    state = {"model": model_state, "optimizer": optimizer_state, "optimizer_step": step}
    if reference is not None:
        state["reference"] = reference.sharded_state_dict(prefix="reference.")
    return state


def save(model: Any, optimizer: torch.optim.Optimizer, reference: Any | None, directory: Path) -> None:
    """Every rank writes its pieces into ``directory`` (one checkpoint for the whole model)."""
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    with _write_results_in_process():
        dist_checkpointing.save(sharded_state(model, optimizer, reference), str(directory))


@contextlib.contextmanager
def _write_results_in_process() -> Iterator[None]:
    """megatron-core's file writer hands its results back through a queue that it would otherwise
    make a multiprocessing Manager's: a spawned server process that re-imports the trainer (≈ 5
    CPU-s and seconds per save on 2 cores) and outlives a process that ends by ``os._exit``. A
    synchronous save (ours) puts and gets those results in this very process — its forked writer
    workers report through a queue of their own — so a thread-safe in-process queue does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def load(model: Any, optimizer: torch.optim.Optimizer, reference: Any | None, directory: Path) -> None:
    """Every rank reads its pieces, in its own layout, from a checkpoint :func:`save` wrote in any."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(sharded_state(model, optimizer, reference), str(directory))
    model.load_state_dict(loaded["model"])
    for state in loaded["optimizer"]["state"].values():
        state["step"] = torch.tensor(float(loaded["optimizer_step"]))
    optimizer.load_state_dict(loaded["optimizer"])
    if reference is not None:
        reference.load_state_dict({k.removeprefix("reference."): v for k, v in loaded["reference"].items()})
