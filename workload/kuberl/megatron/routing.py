"""Routing replay (R3) on Megatron-core: a batch's routes (:mod:`kuberl.models.moe_routing`, [B, L,
layers, k]) taken by the GPTModel's top-k routers.

megatron-core's routers call ``router_replay.get_replay_topk(scores, k, …, default_compute_topk)``
when they hold a replay object; :class:`ReplayedTopK` is one that returns the recorded experts where
the route is known and the router's own choice elsewhere, with the router's own scores at those
experts (so the gradient reaches the router), as the HF path does.

Token order: a MoE layer routes its input [s, b, h] flattened sequence-major, and under sequence
parallelism each tensor-parallel rank routes its own contiguous slice of s; a router's layer is its
global ``layer_number`` (1-based, pipeline offset included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..models.moe_routing import replayed_experts


class ReplayedTopK:
    """What a router's ``router_replay`` is asked for: (scores at the chosen experts, their indices)."""

    def __init__(self, target: torch.Tensor):
        self.target = target  # [tokens, k], −1 where unknown

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        if default_compute_topk is None:
            raise ValueError("megatron-core gave no top-k to fall back on")
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        experts = replayed_experts(self.target, own)
        return scores.gather(1, experts), experts


def _routers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "router_replay") and getattr(m, "layer_number", None)]


def tokens_of_this_rank(routes: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[B, L, layers, k] → [L', B, layers, k] in a MoE layer's token order on this rank (L' = L, or
    this tensor-parallel rank's slice of L under sequence parallelism)."""
    ordered = routes.transpose(0, 1)
    if not sequence_parallel:
        return ordered
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    return ordered.chunk(size)[parallel_state.get_tensor_model_parallel_rank()]


@contextlib.contextmanager
def replaying(model: Any, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``model``'s routers take ``routes`` (None, no layers, or a dense model:
    nothing changes). No activation is recomputed in the backward, so the forward is all it needs."""
    routers = [] if routes is None or routes.shape[2] == 0 else _routers(model)  # no module walk without routes
    if not routers or routes is None:
        yield
        return
    local = tokens_of_this_rank(routes, model.config.sequence_parallel)
    before = [router.router_replay for router in routers]
    for router in routers:
        layer = local[:, :, router.layer_number - 1]
        router.router_replay = ReplayedTopK(layer.reshape(-1, layer.shape[-1]))
    try:
        yield
    finally:
        for router, replay in zip(routers, before, strict=True):
            router.router_replay = replay
