"""Context parallelism without Transformer Engine: a row's positions split over the ranks of a
context-parallel group, attention over the whole row.

megatron-core runs context parallelism only through Transformer Engine's attention (its local
attention refuses it), and TE is CUDA-only. This module gives the local layer spec a core attention
for a context-parallel group of size c:

- **Layout** (:func:`context_positions`): a row of width W (a multiple of 2c) is cut into 2c equal
  chunks; rank r holds chunks r and 2c − 1 − r — Megatron's load-balanced order, which its rotary
  embedding assumes when it picks this rank's positions. Under a causal mask every rank then holds as
  many query–key pairs.
- **Attention** (:class:`ContextParallelAttention`): each rank computes q, k, v for its own positions,
  all-gathers k and v of the whole row (:func:`gather_positions`, whose backward all-reduces the
  gradient — every rank's queries read every key — and keeps this rank's positions), and runs
  the local attention (:mod:`.attention`) from its queries to every key under its queries' mask. This is
  all-gather context parallelism (as Llama 3 was trained at long context), not ring attention: k and
  v of the whole row in memory, one collective per layer instead of c − 1 ring steps. The attention
  scores, [b, heads, W ÷ c, W] on each rank (computed blockwise by the attention kernel), are what
  context parallelism divides.
- **Reading**: the per-position log-probs of a rank's positions are all-gathered back into whole rows
  (:func:`gather_positions` with ``sum_gradients=False``), so every rank of the group computes the
  same loss; each rank's backward then keeps the gradient of its own positions, and the parameters'
  gradients are summed over the group (:func:`.actor.average_over_data_parallel_ranks`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist


def context_positions(width: int, size: int, rank: int) -> torch.Tensor:
    """The positions of a row of ``width`` that context-parallel rank ``rank`` of ``size`` holds, in
    the order it holds them: chunks ``rank`` and ``2·size − 1 − rank`` of ``2·size``."""
    if width % (2 * size):
        raise ValueError(f"a row of {width} positions does not split into 2 × {size} equal chunks")
    chunk = width // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def context_group() -> tuple[int, int, Any]:
    """(this rank's index, the size, the group) of its context-parallel group."""
    from megatron.core import parallel_state

    return (parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_group())


class _GatherPositions(torch.autograd.Function):
    """Forward: every rank's positions along ``dim`` all-gathered into whole rows in position order.
    Backward: the gradient of this rank's positions — summed over the group first when the ranks'
    computations after the gather differ (``sum_gradients``), taken as it is when they are the same."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: Any, sum_gradients: bool) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        width = local.shape[dim] * size
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        whole = local.new_empty((*local.shape[:dim], width, *local.shape[dim + 1:]))
        for r, part in enumerate(parts):
            whole.index_copy_(dim, context_positions(width, size, r).to(local.device), part)
        ctx.dim, ctx.group, ctx.sum_gradients = dim, group, sum_gradients
        ctx.mine = context_positions(width, size, rank).to(local.device)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.sum_gradients:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(ctx.dim, ctx.mine), None, None, None


def gather_positions(local: torch.Tensor, dim: int, sum_gradients: bool) -> torch.Tensor:
    """This rank's positions (:func:`context_positions`) along ``dim`` → the whole rows, on every rank
    of its context-parallel group (differentiable; ``sum_gradients``: see :class:`_GatherPositions`)."""
    _, size, group = context_group()
    if size == 1:
        return local
    return _GatherPositions.apply(local, dim, group, sum_gradients)


@functools.cache
def context_parallel_attention() -> type:
    """The core attention of the local layer spec under context parallelism (defined on first use:
    megatron-core is imported where it is needed, not with this package)."""
    import dataclasses

    from .attention import sdpa_attention

    class ContextParallelAttention(sdpa_attention()):  # type: ignore[misc]
        """The local attention (:mod:`.attention`) from this rank's queries to the keys and values of
        the whole row (module docstring), under a mask of this rank's queries over the whole row, [b, 1, W ÷ c, W]."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            # the local attention refuses context parallelism because it does not gather; this one does
            super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
            self.config = config

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> torch.Tensor:
            key, value = (gather_positions(t, 0, sum_gradients=True) for t in (key, value))  # [W, b, g, d]
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return ContextParallelAttention
