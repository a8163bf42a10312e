"""Megatron-core on CPU: the CUDA-only calls of megatron-core 0.16 pointed at the CPU.

Megatron-core builds and runs on CPU with ``TransformerConfig(use_cpu_initialization=True)``, the
local (non-Transformer-Engine) layer spec and gloo, except for a few calls that assume a CUDA device:

- ``torch.cuda.current_device()`` — the rotary embedding moves ``inv_freq`` there (forward);
- ``torch.cuda.manual_seed(seed)`` / ``torch.cuda.get_rng_state()`` — ``model_parallel_cuda_manual_seed``
  seeds the device and keeps its generator's state per stream;
- ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` — the RNG tracker that
  gives tensor-parallel ranks their own dropout streams saves and restores the device's generator;
- pipeline parallelism: the schedules count tokens in ``torch.zeros(..., device="cuda")``, the p2p
  exchange may call ``torch.cuda.synchronize()``, and a tied embedding's start-up all-reduce moves
  the last stage's copy with ``Tensor.cuda()``;
- context parallelism: the rotary embedding picks this rank's positions with indices it builds in
  pinned memory (``get_pos_emb_on_this_cp_rank``), which needs an accelerator.

``cpu_shim()`` maps them to the CPU (device ``"cpu"``, the CPU generator, no-ops; the schedules'
module sees a ``torch`` whose ``zeros`` takes CUDA for the CPU) while it is active and restores them
after. It is used only when the trainer's device is the CPU: the same code runs on CUDA/NPU without
it. Nothing else in megatron-core is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _get_cpu_rng_state(device: Any = "cpu", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """The rotary embedding's rows for this rank's positions (:func:`.context_parallel.context_positions`,
    Megatron's order) without pinned memory."""
    from .context_parallel import context_positions

    mine = context_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank())
    return pos_emb.index_select(seq_dim, mine.to(pos_emb.device))


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _swapped(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _TorchOnCpu:
    """``torch`` as a module that asks for ``device="cuda"`` sees it: the same attributes, but
    ``zeros`` on the CPU when told CUDA (megatron-core's pipeline schedules count tokens on it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if str(device).startswith("cuda") else device, **kwargs)


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Megatron-core's CUDA-only calls answered by the CPU for the duration of the block."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random

    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(_swapped(torch.cuda, "manual_seed", torch.manual_seed))
        stack.enter_context(_swapped(torch.cuda, "get_rng_state", _get_cpu_rng_state))
        stack.enter_context(_swapped(tp_random, "_get_cuda_rng_state", _get_cpu_rng_state))
        stack.enter_context(_swapped(tp_random, "_set_cuda_rng_state", _set_cpu_rng_state))
        stack.enter_context(_swapped(torch.cuda, "synchronize", lambda device=None: None))
        stack.enter_context(_swapped(torch.Tensor, "cuda", lambda self, *args, **kwargs: self))
        stack.enter_context(_swapped(schedules, "torch", _TorchOnCpu()))
        stack.enter_context(_swapped(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank))
        yield


def on_device(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """``cpu_shim()`` on the CPU, nothing on an accelerator."""
    return cpu_shim() if device.type == "cpu" else contextlib.nullcontext()
