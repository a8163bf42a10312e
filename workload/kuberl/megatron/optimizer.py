"""The Megatron actor's optimizer: AdamW on every rank's pieces, or with ``spec.trainer.distributedOptimizer``
its state sharded over the data-parallel ranks (ZeRO-1, torch's ``ZeroRedundancyOptimizer``).

Sharded, each data-parallel rank owns some of the parameters it holds (whole parameters, balanced
by size) and keeps AdamW's moments for those alone: per-rank optimizer memory ≈ 1/|DP| of AdamW's
2 × 4 bytes per parameter. Gradients are averaged over the data-parallel ranks as before (every
rank has the whole gradient: ZeRO-1, not 2); each rank steps its own parameters and then broadcasts
them to the others, so every replica holds the same weights — the update is AdamW's exactly.

Checkpoints stay in :mod:`.checkpoint`'s layout-free format: before a save every rank gathers the
moments of the parameters it holds (:func:`whole_adamw`: one collective per data-parallel rank,
the whole state held for the save's duration), and a load reads the whole state and keeps its own
part, so a sharded run resumes unsharded or in another layout and back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, distributed: bool) -> torch.optim.Optimizer:
    """AdamW (no weight decay, foreach) over ``params``, its state sharded over the data-parallel
    group when ``distributed`` and that group has more than one rank."""
    from megatron.core import parallel_state

    params = list(params)
    if distributed and parallel_state.get_data_parallel_world_size() > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=parallel_state.get_data_parallel_group(),
                                       lr=lr, weight_decay=0.0, foreach=True)  # fmt: skip
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def whole_adamw(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                gather: bool = True) -> torch.optim.Optimizer:
    """``optimizer`` itself, or for a sharded one a plain AdamW over ``params`` (the parameters this
    rank holds) with their whole state gathered (every data-parallel rank must call it), or none
    (``gather`` false: for a load to fill)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    whole = torch.optim.AdamW(params, lr=optimizer.param_groups[0]["lr"], weight_decay=0.0, foreach=True)
    if not gather:
        return whole
    mine = None
    for rank in range(optimizer.world_size):  # each rank's turn: only the receiving rank keeps it
        optimizer.consolidate_state_dict(to=rank)
        if rank == optimizer.rank:
            mine = optimizer.state_dict()
    assert mine is not None
    whole.load_state_dict(mine)
    return whole


def keep_own_part(optimizer: torch.optim.Optimizer, whole: torch.optim.Optimizer) -> None:
    """After ``whole`` (from :func:`whole_adamw`) was loaded: a sharded ``optimizer`` keeps its part."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_state_dict(whole.state_dict())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of optimizer state this rank holds (AdamW's moments; a sharded optimizer's own part)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(t.numel() * t.element_size() for state in local.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)
