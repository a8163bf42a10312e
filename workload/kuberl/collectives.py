"""Collectives over the trainer's default process group that are no-ops in a world of one (or when
torch.distributed is not initialised): every caller on every rank must still call them."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from .devices import collective_device

T = TypeVar("T")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_from_rank0(value: T) -> T:
    """Rank 0's ``value`` on every rank (any picklable object)."""
    box = [value]
    if world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order."""
    if world_size() == 1:
        return [value]
    out: list[T] = [value] * world_size()
    dist.all_gather_object(out, value)
    return out


def all_reduce(value: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> float:
    return all_reduce_many([value], op)[0]


def all_reduce_many(values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """Element-wise reduction of every rank's ``values`` (same length on every rank), in one call,
    in float32."""
    if not dist.is_initialized():
        return list(values)
    # float32: HCCL on Atlas A2/A3 reduces no float64 (CANN's HcclAllReduce data types); counts stay
    # exact below 2**24. NCCL and HCCL take tensors on the accelerator only.
    t = torch.tensor(values, dtype=torch.float32, device=collective_device())
    dist.all_reduce(t, op=op)
    return [float(x) for x in t.tolist()]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End a process that ran gloo collectives, skipping interpreter finalisation.

    With torch 2.13, gloo's worker threads outlive ``destroy_process_group``. One that frees a
    just-finished collective's tensors while the interpreter finalises needs the GIL, is
    ``pthread_exit``-ed by CPython and aborts the whole process (SIGABRT, "terminate called without
    an active exception"): a rank that finished its work would look failed and restart its gang.
    Logging and the standard streams are flushed first; call it after ``destroy_process_group``.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
