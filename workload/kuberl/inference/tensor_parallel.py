"""The torch engine as one replica over several processes (hosts): tensor parallelism by PyTorch's
``parallelize_module`` with the model's own Hugging Face plan (``config.base_model_tp_plan``: q/k/v and
gate/up column-wise, o and down row-wise), over a gloo (CPU) or NCCL group of the replica's processes.

Rank 0, the leader, serves HTTP, schedules and samples; each engine step it sends the step's
``StepPlan`` to the other ranks, and every rank runs it over its shard of the weights and of the KV
cache (its heads), the row-wise layers' all-reduce leaving every rank the whole hidden state and
logits. Weight updates arrive whole at the leader, which sends them on; every rank keeps its shard.
The commands, in the order the leader sends them, are all a worker does (``follow``); a worker whose
leader is gone fails its next collective and exits, so the replica restarts as a unit.

Formula: with t ranks, a layer of h heads (g key-value heads) and MLP width f keeps h/t, g/t and f/t
of them per rank, so t must divide h, g and f (``tp_problem``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from .step_runner import StepOutput, StepPlan, StepRunner

log = logging.getLogger("kuberl.inference")
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
REPLICA_BROKEN_EXIT = 3  # the leader's exit code when its group broke
GROUP_TIMEOUT = timedelta(minutes=30)  # a collective (or the rendezvous) waiting longer fails the process; an idle
# leader pings its workers every step_runner.KEEPALIVE_SECONDS, well inside it


def tp_problem(config: Any, size: int) -> str | None:
    """Why ``size`` ranks cannot split a model of this config, or None."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return f"{type(config).__name__} has no tensor-parallel plan (base_model_tp_plan)"
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        return f"its tensor-parallel plan uses {unknown}; the torch engine splits {sorted(STYLES)} layers only"
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
             "intermediate_size": config.intermediate_size}
    bad = [f"{name} {value}" for name, value in sizes.items() if value % size]
    return f"{', '.join(bad)} not divisible by {size} ranks" if bad else None


def sharding_plan(model: torch.nn.Module) -> dict[str, ParallelStyle]:
    """The model's Hugging Face plan, its wildcards expanded to this model's module names."""
    prefix = f"{model.base_model_prefix}." if hasattr(model, "base_model_prefix") else ""
    names = [name for name, _ in model.named_modules()]
    return {name: STYLES[style]() for pattern, style in model.config.base_model_tp_plan.items()
            for name in fnmatch.filter(names, prefix + pattern)}


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """``model`` split over ``mesh`` in place: the planned layers' weights become DTensor shards."""
    problem = tp_problem(model.config, mesh.size())
    if problem:
        raise ValueError(f"cannot split the model over {mesh.size()} ranks: {problem}")
    return parallelize_module(model, mesh, sharding_plan(model))


@dataclass
class ReplicaGroup:
    """The replica's processes: rank 0 the leader; ``mesh`` over all of them."""

    rank: int
    size: int
    mesh: DeviceMesh

    @classmethod
    def join(cls, leader: str, rank: int, size: int, device: str = "cpu") -> ReplicaGroup:
        """Rendezvous at ``leader`` (host:port, the leader's) as ``rank`` of ``size``."""
        backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, init_method=f"tcp://{leader}", rank=rank, world_size=size,
                                timeout=GROUP_TIMEOUT)
        return cls(rank, size, init_device_mesh(device, (size,)))

    def send(self, command: tuple[Any, ...]) -> None:
        """The leader: ``command`` to every worker."""
        dist.broadcast_object_list([command], src=0)

    def receive(self) -> tuple[Any, ...]:
        """A worker: the leader's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, tensors: dict[str, torch.Tensor] | None, layout: list[tuple[str, list[int], str]]
              ) -> dict[str, torch.Tensor]:
        """The leader's ``tensors`` (whole) on every rank, in ``layout`` order (name, shape, dtype)."""
        shared = {}
        for name, shape, dtype in layout:
            tensor = tensors[name].contiguous() if tensors is not None else \
                torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0)
            shared[name] = tensor
        return shared


def layout_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()]


class TensorParallelRunner(StepRunner):
    """The leader's runner: every step and weight update goes to the workers first, then runs here. A
    step or update that fails here (a collective whose worker is gone, or anything else once the workers
    were told) leaves the ranks out of step, which cannot be mended in place: the process ends at once,
    and the replica restarts as a unit (its workers fail their next collective in turn)."""

    def __init__(self, model: torch.nn.Module, pad_id: int, group: ReplicaGroup):
        super().__init__(model, pad_id)
        self.group = group

    def run(self, plan: StepPlan) -> StepOutput:
        with self._fatal_if_broken():
            self.group.send(("step", plan))
            return super().run(plan)

    def load_state(self, state: dict[str, torch.Tensor], strict: bool) -> None:
        self.copy_parameters(state)

    def copy_parameters(self, tensors: dict[str, torch.Tensor]) -> None:
        layout = layout_of(tensors)
        with self._fatal_if_broken():
            self.group.send(("weights", layout))
            super().copy_parameters(self.group.share(tensors, layout))

    def keepalive(self) -> None:
        with self._fatal_if_broken():
            self.group.send(("ping",))

    @contextlib.contextmanager
    def _fatal_if_broken(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:  # the process ends on it, said in the log
            log.critical("replica ranks out of step (%r): exiting so that the whole replica restarts", err)
            logging.shutdown()
            os._exit(REPLICA_BROKEN_EXIT)

    def close(self) -> None:
        """Tell the workers the replica is done (they return from ``follow``)."""
        try:
            self.group.send(("stop",))
        except RuntimeError as err:  # a worker already gone: it is restarting, or the replica is
            log.warning("the replica's workers were not told to stop: %s", err)


def follow(runner: StepRunner, group: ReplicaGroup) -> None:
    """A worker's life: run the leader's commands in order until it says stop."""
    log.info("replica rank %d of %d follows its leader", group.rank, group.size)
    while True:
        command = group.receive()
        kind = command[0]
        if kind == "step":
            runner.run(command[1])
        elif kind == "weights":
            runner.copy_parameters(group.share(None, command[1]))
        elif kind == "stop":
            return
        elif kind != "ping":
            raise RuntimeError(f"unknown command from the leader: {kind!r}")
