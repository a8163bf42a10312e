"""The Megatron actor's optimizer: AdamW on every rank's pieces, or with ``spec.trainer.distributedOptimizer``
its state sharded over the data-parallel ranks (ZeRO-1, torch's ``ZeroRedundancyOptimizer``).

Sharded, each data-parallel rank owns some of the parameters it holds (whole parameters, balanced
by size) and keeps AdamW's moments for those alone: per-rank optimizer memory ≈ 1/|DP| of AdamW's
2 × 4 bytes per parameter. Dense parameters are sharded over their data-parallel group, a mixture's
experts over their expert-data-parallel group (the ranks that hold the same experts; where that is
one rank they stay whole): two optimizers stepped as one (:class:`OptimizerSet`). Gradients are
averaged as before (every rank has the whole gradient: ZeRO-1, not 2); each rank steps its own
parameters and broadcasts them to the others, so every replica holds the same weights — the update
is AdamW's exactly.

Checkpoints stay in :mod:`.checkpoint`'s layout-free format: before a save every rank gathers the
moments of the parameters it holds (:func:`whole_adamw`: one collective per data-parallel rank,
the whole state held for the save's duration), and a load reads the whole state and each part keeps
its own (:func:`keep_own_part`), so a sharded run resumes unsharded or in another layout and back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


@dataclass
class OptimizerSet:
    """Optimizers over disjoint parameters, stepped as one (what the actor's step needs of an optimizer)."""

    parts: list[torch.optim.Optimizer]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()


def _adamw(params: list[torch.nn.Parameter], lr: float, group: Any = None, size: int = 1) -> torch.optim.Optimizer:
    """AdamW (no weight decay, foreach) over ``params``, sharded over ``group`` when it has ``size`` > 1 ranks."""
    if size > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=group,
                                       lr=lr, weight_decay=0.0, foreach=True)  # fmt: skip
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, distributed: bool) -> Any:
    """AdamW over ``params``; when ``distributed``, dense parameters sharded over the data-parallel
    group and experts over the expert-data-parallel group (each where it has more than one rank)."""
    from megatron.core import parallel_state as ps

    params = list(params)
    if not distributed:
        return _adamw(params, lr)
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    parts = [_adamw(dense, lr, ps.get_data_parallel_group(), ps.get_data_parallel_world_size())]
    if experts:
        parts.append(_adamw(experts, lr, ps.get_expert_data_parallel_group(),
                            ps.get_expert_data_parallel_world_size()))
    return OptimizerSet(parts)


def _parts(optimizer: Any) -> list[torch.optim.Optimizer]:
    return optimizer.parts if isinstance(optimizer, OptimizerSet) else [optimizer]


def _params(part: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in part.param_groups for p in group["params"]]


def _gathered_state(part: torch.optim.Optimizer) -> dict[torch.nn.Parameter, dict[str, Any]]:
    """Every parameter's AdamW state in ``part``, gathered from its owners for a sharded part (every
    rank of its group must call it)."""
    if not isinstance(part, ZeroRedundancyOptimizer):
        return dict(part.state)
    mine: dict[str, Any] | None = None
    for rank in range(part.world_size):  # each rank's turn: only the receiving rank keeps it
        part.consolidate_state_dict(to=rank)
        if rank == part.rank:
            mine = part.state_dict()
    assert mine is not None
    params = _params(part)
    return {params[index]: state for index, state in mine["state"].items() if state}


def whole_adamw(optimizer: Any, params: list[torch.nn.Parameter], gather: bool = True) -> torch.optim.Optimizer:
    """``optimizer`` itself when it is one plain AdamW, else a plain AdamW over ``params`` (every
    parameter this rank holds) with the whole state gathered (every rank must call it), or none
    (``gather`` false: for a load to fill)."""
    if isinstance(optimizer, torch.optim.AdamW):
        return optimizer
    whole = torch.optim.AdamW(params, lr=optimizer.param_groups[0]["lr"], weight_decay=0.0, foreach=True)
    if gather:
        for part in _parts(optimizer):
            for param, state in _gathered_state(part).items():
                whole.state[param] = state
    return whole


def keep_own_part(optimizer: Any, whole: torch.optim.Optimizer) -> None:
    """After ``whole`` (:func:`whole_adamw`) was loaded: each part of ``optimizer`` takes its
    parameters' state (a sharded part keeps its own parameters' only)."""
    if whole is optimizer:
        return
    for part in _parts(optimizer):
        params = _params(part)
        hyper = {k: v for k, v in whole.param_groups[0].items() if k != "params"}
        part.load_state_dict({"state": {i: whole.state[p] for i, p in enumerate(params) if p in whole.state},
                              "param_groups": [{**hyper, "params": list(range(len(params)))}]})


def state_bytes(optimizer: Any) -> int:
    """The bytes of optimizer state this rank holds (AdamW's moments; a sharded part's own share)."""
    locals_ = [part.optim if isinstance(part, ZeroRedundancyOptimizer) else part for part in _parts(optimizer)]
    return sum(t.numel() * t.element_size() for local in locals_ for state in local.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
