"""The decoupled PPO objective (AReaL), one function for every algorithm.

For each generated token, with π_θ the policy being trained, π_prox the proximal policy (the
weights at the start of this step, recomputed by the trainer) and π_behav the behaviour policy
(the possibly older weights that sampled the token, logged by the inference engine):

    r = π_θ / π_prox                                     (trust-region ratio)
    w = π_prox / π_behav, detached                       (off-policy correction)
    ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))     (clip-higher when ε_high > ε_low)
    ℓ = min(ℓ, −A·c)        for A < 0, when dual clip c is set
    loss = Σ mask · w · ℓ / N  (+ kl_coef · Σ mask · KL_k3(π_θ ‖ π_ref) / N)

Tokens whose w exceeds ``behavior_imp_cap`` are masked out (too off-policy to correct). N is the
number of valid tokens (``token_mean``) or batch size × max new tokens (``seq_sum_const``, Dr.GRPO).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from .algorithms import AlgorithmConfig

log = logging.getLogger("kuberl.trainer")


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: dict[str, torch.Tensor]  # 0-dim, detached, on the loss's device (read them once per step)


VALID_TOKENS = "ppo_actor/valid_tokens"
SUMMED_STATS = ("ppo_actor/loss", "ppo_actor/kl", VALID_TOKENS)
"""Stats of one micro-batch that add up over a batch's micro-batches (the loss and the KL term are
already divided by the whole batch's ``normalizer``); the other stats are means over the
micro-batch's valid tokens, so a batch's is their mean weighted by ``ppo_actor/valid_tokens``."""


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: AlgorithmConfig,
    ref_logp: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> LossOutput:
    """Decoupled PPO loss over [batch, tokens] tensors; ``advantages`` broadcast per token.

    ``normalizer`` overrides N (used when a batch is split into micro-batches, so the sum of the
    micro-batch losses equals the full-batch loss).
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - prox_logp)
    behav_w = torch.exp(prox_logp - behav_logp).detach()
    if config.behavior_imp_cap is not None:
        mask = mask * (behav_w <= config.behavior_imp_cap).to(mask.dtype)
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1).expand_as(logp)
    surrogate = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    per_token = torch.maximum(surrogate, clipped)
    if config.dual_clip is not None:
        dual = torch.minimum(per_token, -adv * config.dual_clip)
        per_token = torch.where(adv < 0, dual, per_token)
    per_token = per_token * behav_w
    if normalizer is None:
        if config.loss_agg == "seq_sum_const":
            normalizer = float(logp.shape[0] * config.max_new_tokens)
        else:
            normalizer = float(mask.sum().clamp(min=1.0))
    loss = (per_token * mask).sum() / normalizer
    kl_value = torch.zeros((), device=logp.device)
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3 estimator, ≥ 0
        kl_term = (kl * mask).sum() / normalizer
        loss = loss + config.kl_coef * kl_term
        kl_value = kl_term.detach()
    with torch.no_grad():
        valid = mask.sum().clamp(min=1.0)
        clipped_frac = (((ratio < 1 - config.clip_low) | (ratio > 1 + config.clip_high)).to(mask.dtype) * mask)
        stats = {
            "ppo_actor/loss": loss.detach(),
            "ppo_actor/importance_weight": (ratio * mask).sum() / valid,
            "ppo_actor/clip_ratio": clipped_frac.sum() / valid,
            "ppo_actor/behave_imp_weight": (behav_w * mask).sum() / valid,
            VALID_TOKENS: mask.sum(),
            "ppo_actor/kl": kl_value,
        }
    return LossOutput(loss, stats)


def behaviour_gap(prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                  fresh_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ fresh · |log π_prox − log π_behav|, Σ fresh) over tokens sampled by the weights π_prox is
    computed with (version lag 0), as 0-dim tensors. There the two log-probs differ only by numerics
    (≈ 1e-6 in float32, ≈ 1e-2 in bf16); a large mean means the engine is not sampling from the
    trainer's policy."""
    fresh = fresh_mask.to(prox_logp.dtype)
    return ((prox_logp.detach() - behav_logp).abs() * fresh).sum(), fresh.sum()


BEHAVIOUR_GAP_LIMIT = 0.2
"""Nats. Above this mean gap at version lag 0 the trainer warns: bf16 engines differ from the
trainer by ≈ 0.01–0.05, a wrong or stale layer in the engine by whole nats."""


@dataclass
class BehaviourGapMonitor:
    """Follows ``mismatch/behav_logp_gap`` over a run; warns (first time, then every
    ``every`` steps while it lasts) when it exceeds :data:`BEHAVIOUR_GAP_LIMIT`."""

    warn: bool = True
    every: int = 50
    last: float | None = None  # None while no step had fresh tokens
    values: list[float] = field(default_factory=list)
    _warned_at: int | None = None

    def observe(self, step: int, stats: dict[str, float]) -> None:
        gap = stats.get("mismatch/behav_logp_gap", math.nan)
        if math.isnan(gap):
            return
        self.last = gap
        self.values.append(gap)
        due = self._warned_at is None or step - self._warned_at >= self.every
        if gap > BEHAVIOUR_GAP_LIMIT and due:
            self._warned_at = step
            if self.warn:
                log.warning(
                    "step %d: the inference engine's log-probs disagree with the trainer's for tokens sampled "
                    "by the very weights being trained: mean |log π_behav − log π_θ| = %.3f nats over %d tokens "
                    "(limit %.2f). The engine is not serving the trainer's policy (a layer that missed the "
                    "weight update, another dtype or model): the run learns from noise",
                    step, gap, int(stats.get("mismatch/fresh_tokens", 0)), BEHAVIOUR_GAP_LIMIT)

    def summary(self) -> dict[str, float | None]:
        return {"behav_logp_gap_mean": round(sum(self.values) / len(self.values), 6) if self.values else None,
                "behav_logp_gap_max": round(max(self.values), 6) if self.values else None}
