"""How a Megatron parameter is split over the tensor-parallel ranks, and the split and its inverse.

Megatron marks each tensor-parallel parameter (``tensor_model_parallel``) with the dimension it is
split on (``partition_dim``): 0 for column-parallel layers (QKV, the MLP's first layer, the
vocabulary-parallel embedding and output layer), 1 for row-parallel ones (the attention output, the
MLP's second layer); norms are whole on every rank. Rank r of t holds rows ``[r·n/t, (r+1)·n/t)``
of the split dimension — except the gated MLP's first layer, whose rows are ``[gate; up]``: rank r
holds its slice of each half, ``[gate_r; up_r]``. QKV rows are already interleaved by query group
(:mod:`.convert`), so a plain slice gives each rank whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    dim: int | None  # None: the whole tensor on every rank
    gated: bool = False  # rows are [gate; up], each half split alike


WHOLE = Split(None)


def split_of(name: str, param: torch.Tensor, gated_linear_unit: bool) -> Split:
    """The split Megatron gave ``param`` (named ``name`` in the GPTModel)."""
    if not getattr(param, "tensor_model_parallel", False):
        return WHOLE
    gated = gated_linear_unit and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"))
    return Split(int(param.partition_dim), gated)


def shard(full: torch.Tensor, split: Split, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` (of ``size`` ranks); raises if the dimension does not divide."""
    if split.dim is None or size == 1:
        return full
    halves = full.chunk(2, dim=split.dim) if split.gated else (full,)
    pieces = []
    for half in halves:
        if half.shape[split.dim] % size:
            raise ValueError(f"dimension {split.dim} of a {tuple(full.shape)} tensor does not split over {size} "
                             "tensor-parallel ranks")
        pieces.append(half.chunk(size, dim=split.dim)[rank])
    return torch.cat(pieces, dim=split.dim).contiguous()


def unshard(pieces: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from every rank's piece, in rank order (the inverse of :func:`shard`)."""
    if split.dim is None or len(pieces) == 1:
        return pieces[0]
    if not split.gated:
        return torch.cat(pieces, dim=split.dim)
    halves = [p.chunk(2, dim=split.dim) for p in pieces]
    return torch.cat([torch.cat([h[0] for h in halves], dim=split.dim),
                      torch.cat([h[1] for h in halves], dim=split.dim)], dim=split.dim)
