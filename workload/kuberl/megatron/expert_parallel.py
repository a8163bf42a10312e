"""Which experts an expert-parallel rank holds, and their names there (pure).

With expert parallelism ``e``, rank k of the expert-parallel group holds the consecutive experts
``[k·E/e, (k+1)·E/e)`` of each layer's ``E``, as Megatron's ``local_experts.0 … local_experts.{E/e-1}``:
global expert ``g`` is local ``g − k·E/e`` on rank ``k = g ÷ (E/e)``. Everything else (attention, norms,
the router, embeddings) is the same on every rank of the group.
"""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def expert_of(name: str) -> int | None:
    """The expert index in a Megatron parameter name (local or global: the name does not say), None
    for a parameter that is not an expert's."""
    match = _LOCAL_EXPERT.fullmatch(name)
    return int(match[2]) if match else None


def renumbered(name: str, index: int) -> str:
    """``name`` with its expert index replaced by ``index``."""
    match = _LOCAL_EXPERT.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert's parameter")
    return f"{match[1]}{index}{match[3]}"


def experts_per_rank(experts: int, size: int) -> int:
    """E ÷ e; raises when the experts do not split evenly over the expert-parallel ranks."""
    if experts % size:
        raise ValueError(f"{experts} experts do not split over {size} expert-parallel ranks")
    return experts // size


def local_state(state: dict[str, torch.Tensor], experts: int, rank: int, size: int) -> dict[str, torch.Tensor]:
    """A Megatron state dict with every expert under its global index → what expert-parallel rank
    ``rank`` of ``size`` holds: its own experts renumbered from 0, every other parameter unchanged."""
    per_rank = experts_per_rank(experts, size)
    first = rank * per_rank
    out = {}
    for name, tensor in state.items():
        index = expert_of(name)
        if index is None:
            out[name] = tensor
        elif first <= index < first + per_rank:
            out[renumbered(name, index - first)] = tensor
    return out


def global_name(name: str, rank: int, per_rank: int) -> str:
    """The name under which rank ``rank``'s local expert parameter ``name`` is known to the whole model."""
    index = expert_of(name)
    return name if index is None else renumbered(name, rank * per_rank + index)
