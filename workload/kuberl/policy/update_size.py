"""How far one step moved the policy: the size of the optimizer's update relative to the weights, and
the KL between the policies before and after the step (issue 68: a trust region is only evidence if
the update it bounds is measured).

- ``ppo_actor/update_size`` = ‖Δθ‖ / ‖θ‖ over the trained weights (the whole model, or a LoRA adapter),
  per optimizer update. Δθ is read back from AdamW's state rather than from a copy of the weights
  (which would cost a model's worth of memory): with weight decay 0 — both actors' — torch's AdamW
  moves every parameter by Δθ = −lr / (1 − β₁ᵗ) · m_t / (√v_t / √(1 − β₂ᵗ) + ε) at its step t
  (:func:`adamw_steps` also reads weight decay and amsgrad).
  The global norms are the backend's: :func:`update_norms` for FSDP2's DTensors (or plain tensors),
  ``kuberl.megatron.norms.update_norms`` for Megatron's split, expert and ZeRO-sharded pieces.
- ``ppo_actor/update_kl`` ≈ KL(π_new ‖ π_old) per token, on a probe of the step's rows: with
  r = π_new / π_old of each sampled token, the mean of r·log r − r + 1 (≥ 0 token by token; its
  expectation is KL(π_new ‖ π_old) when the tokens are drawn from π_old — here from π_behav, at most η
  versions older). π_old is the probe's log-probability before the step's first update, π_new after
  its last: two forward passes over :data:`PROBE_ROWS` rows per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..weights.transport import whole_tensor

PROBE_ROWS = 4
"""Rows of each rank's first micro-batch that ``ppo_actor/update_kl`` is measured on (two forward
passes of this many rows a step: ≈ 2 % of the main example's step)."""

UpdateNormer = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
"""(‖Δθ‖, ‖θ‖) of an optimizer's last step over every rank's pieces of the weights it trains."""


def adamw_steps(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(θ, Δθ) of each parameter ``optimizer`` (torch's AdamW, on this rank's pieces) moved at its last
    step; nothing for a parameter it has not stepped. θ is the parameter itself (a backend reads how
    its pieces add up from its attributes, which a detached copy lacks). With weight decay λ, AdamW
    first scales θ by 1 − lr·λ: Δθ = a − lr·λ·θ_old with a the module docstring's Δθ and
    θ_old = (θ − a) / (1 − lr·λ); with amsgrad, v_t is its running maximum. Computed a group and a
    step count at a time with torch's foreach kernels, as AdamW steps."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, decay = float(group["lr"]), group["eps"], group.get("weight_decay", 0.0)
        second_moment = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
        by_step: dict[float, list[torch.Tensor]] = {}
        for param in group["params"]:
            if optimizer.state.get(param):
                by_step.setdefault(float(optimizer.state[param]["step"]), []).append(param)
        for t, params in by_step.items():
            states = [optimizer.state[p] for p in params]
            denominators = torch._foreach_sqrt([s[second_moment] for s in states])
            torch._foreach_div_(denominators, math.sqrt(1 - beta2**t))
            torch._foreach_add_(denominators, eps)
            deltas = torch._foreach_div([s["exp_avg"] for s in states], denominators)
            torch._foreach_mul_(deltas, -lr / (1 - beta1**t))
            if decay:
                old = torch._foreach_sub([p.detach() for p in params], deltas)
                torch._foreach_div_(old, 1 - lr * decay)
                torch._foreach_add_(deltas, old, alpha=-lr * decay)
            yield from zip(params, deltas, strict=True)


@torch.no_grad()
def update_norms(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖Δθ‖, ‖θ‖) of ``optimizer``'s last step, for parameters that are whole tensors or DTensors
    (FSDP2's shards: their norms are reduced over the mesh)."""
    pairs = list(adamw_steps(optimizer))
    if not pairs:
        return torch.zeros(()), torch.zeros(())
    delta = torch.nn.utils.get_total_norm([d for _, d in pairs])
    weights = torch.nn.utils.get_total_norm([p for p, _ in pairs])
    return whole_tensor(delta), whole_tensor(weights)


def relative_size(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """‖Δθ‖ / ‖θ‖ (0 for weights that are all zero: nothing to be relative to)."""
    return torch.where(weights > 0, delta / weights.clamp(min=torch.finfo(weights.dtype).tiny), 0.0)


def update_kl_sums(old_logp: torch.Tensor, new_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ mask · (r·log r − r + 1), Σ mask] with r = exp(new − old): the module docstring's estimate of
    KL(π_new ‖ π_old) before its division, so that ranks add their sums first."""
    log_r = (new_logp - old_logp).float()
    r = log_r.exp()
    mask = mask.float()
    return torch.stack([((r * log_r - r + 1) * mask).sum(), mask.sum()])
