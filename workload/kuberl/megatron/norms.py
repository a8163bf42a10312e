"""Global norms over a Megatron layout's pieces: every piece of every parameter counted once — a
tensor-parallel split summed over its ranks, an expert on the one expert-parallel rank that holds it,
a whole parameter (the same on every rank of a stage) once, a tied last stage's copy of the
embedding not at all, and every pipeline stage added up (:func:`global_squared_norm`). The gradient
norm for clipping (``kuberl.megatron.actor.reduce_and_clip_gradients``) and the update's size
(:func:`update_norms`, ``kuberl.policy.update_size``) are both this norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..policy.update_size import adamw_steps

SPLIT, EXPERTS, WHOLE = range(3)


def piece_kind(param: torch.Tensor) -> int | None:
    """How ``param``'s pieces add up over ranks (:data:`SPLIT`, :data:`EXPERTS`, :data:`WHOLE`), or None
    for a tied last stage's copy of the embedding (counted where the first stage holds it)."""
    if getattr(param, "shared", False):
        return None
    if getattr(param, "expert_parallel", False):
        return EXPERTS
    return SPLIT if getattr(param, "tensor_model_parallel", False) else WHOLE


def squared_sums(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """[Σ ‖x‖² over the split, expert and whole parameters] of (parameter, x) pairs, on ``device`` (zeros
    for none: still all-reduced, so it must live where the collective's backend can reach it — NCCL has
    no CPU tensors)."""
    sums = torch.zeros(3, device=device)
    for param, x in pairs:
        kind = piece_kind(param)
        if kind is not None:
            sums[kind] += x.float().pow(2).sum().to(device)
    return sums


def global_squared_norm(split: torch.Tensor, experts: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """‖x‖² = all-reduce_PP(all-reduce_TP(Σ_split ‖x_r‖²) + all-reduce_EP(Σ_experts ‖x‖²) + Σ_whole ‖x‖²)
    (each argument a scalar, or a vector of several norms' sums taken at once)."""
    from megatron.core import parallel_state

    dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    total = split + experts + whole
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


@torch.no_grad()
def update_norms(optimizer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖Δθ‖, ‖θ‖) of the last step of the actor's optimizer (``kuberl.megatron.optimizer``: one AdamW,
    or ZeRO-sharded parts, each data-parallel rank stepping the parameters it owns — their sums added
    over the part's group first, so each parameter counts once)."""
    parts = getattr(optimizer, "parts", [optimizer])
    device = next((p.device for part in parts for g in part.param_groups for p in g["params"]), torch.device("cpu"))
    sums = torch.zeros(2, 3, device=device)  # [Δθ, θ] × [split, experts, whole]
    for part in parts:
        local = part.optim if isinstance(part, ZeroRedundancyOptimizer) else part
        pairs = list(adamw_steps(local))
        part_sums = torch.stack([squared_sums(((p, d) for p, d in pairs), device),
                                 squared_sums(((p, p) for p, _ in pairs), device)])
        if isinstance(part, ZeroRedundancyOptimizer):
            dist.all_reduce(part_sums, group=part.process_group)
        sums += part_sums
    delta, weights = global_squared_norm(sums[:, SPLIT].clone(), sums[:, EXPERTS].clone(), sums[:, WHOLE]).sqrt()
    return delta, weights
