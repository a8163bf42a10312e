"""The decoupled PPO objective (AReaL), one function for every algorithm and both backends.

For each generated token, with π_θ the policy being trained, π_prox the proximal policy (the
weights at the start of this step, recomputed by the trainer) and π_behav the behaviour policy
(the possibly older weights that sampled the token, logged by the inference engine):

    r = π_θ / π_prox                                     (trust-region ratio, per token)
        or, ratio "sequence" (GSPO), s = exp(mean_t log(π_θ / π_prox)) of the token's sequence
        or, clip anchor "behavior", r = π_θ / π_behav with w replaced by what the correction leaves of
        it: 1 (mask) or min(w, high) / w (truncate) — the same gradient where nothing is clipped, and a
        trust region around the sampling policy when π_prox = π_θ (one mini-batch), where the ratio to
        π_prox is 1 and its clip never binds
    w = π_prox / π_behav, detached                       (off-policy correction, per token)
        or the sequence's Π_t w_t ("sequence") or exp(mean_t log w_t) ("geometric")
    ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))     (clip-higher when ε_high > ε_low)
    ℓ = min(ℓ, −A·c)        for A < 0, when dual clip c is set
    loss = Σ mask · w · ℓ / N  (+ kl_coef · Σ mask · KL_k3(π_θ ‖ π_ref) / N)

How w enters (``correction``): "mask" keeps w and masks out the tokens (or, at sequence level, whole
sequences) whose w leaves [low, high] (MIS; IcePop is the two-sided token mask; the default — high 5,
no low — is AReaL's cap); "truncate" uses min(w, high) and masks nothing (TIS). N is the number of
valid tokens (``token_mean``), batch size × max new tokens (``seq_sum_const``, Dr.GRPO), or — GSPO,
``seq_mean`` — the number of sequences, each sequence's Σ_t mask · w · ℓ first divided by its length.
GSPO's gradient comes through the token form s_t = sg(s) · π_θ(y_t) / sg(π_θ(y_t)): its value is s,
its gradient s · ∇ log π_θ(y_t), so the sequence's mean over tokens is GSPO's ∇s.

Diagnostics of the engine–trainer mismatch, over the valid tokens, with ρ = π_prox / π_behav:
``mismatch/k3_kl`` = mean(ρ − 1 − log ρ) (k3 estimate of KL(π_behav ‖ π_prox)), ``mismatch/chi2`` =
mean((ρ − 1)²) (χ²(π_prox ‖ π_behav) = E_behav[ρ²] − 1, as E_behav[ρ] = 1: the same expectation as
mean(ρ²) − 1 without its zero-mean term 2 · mean(ρ − 1), whose sampling noise, ≈ 2σ(ρ)/√N, swamps
a mismatch of bfloat16 size; never negative), and the fractions of tokens the correction masked or
truncated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..api.algorithm import ClipAnchor, CorrectionLevel, CorrectionMode, RatioLevel
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


def loss_normalizer(config: AlgorithmConfig, rows: float, tokens: Callable[[], float]) -> float:
    """N, the loss's denominator (module docstring), of a batch of ``rows`` sequences: rows × max new
    tokens (``seq_sum_const``, Dr.GRPO), rows (``seq_mean``, GSPO) or ``tokens()`` valid tokens
    (``token_mean``: asked only then, as counting them may be a collective); at least 1."""
    if config.loss_agg == "seq_sum_const":
        return max(rows, 1.0) * config.max_new_tokens
    if config.loss_agg == "seq_mean":
        return max(rows, 1.0)
    return max(tokens(), 1.0)


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
    given = mask.to(logp.dtype)
    log_w = (prox_logp - behav_logp).detach()
    weight, mask, truncated = behaviour_weight(log_w, given, config)
    if config.clip_anchor == ClipAnchor.BEHAVIOR:  # r already carries w: what the correction left of it stays
        ratio = trust_ratio(logp, behav_logp, given, config.ratio_level)
        weight = weight * torch.exp(-log_w)
    else:
        ratio = trust_ratio(logp, prox_logp, given, config.ratio_level)
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1).expand_as(logp)
    surrogate = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    per_token = torch.maximum(surrogate, clipped)
    if config.dual_clip is not None:
        dual = torch.minimum(per_token, -adv * config.dual_clip)
        per_token = torch.where(adv < 0, dual, per_token)
    per_token = per_token * weight
    if config.loss_agg == "seq_mean":  # each sequence's mean over its tokens
        per_token = per_token / given.sum(dim=-1, keepdim=True).clamp(min=1.0)
    if normalizer is None:  # this batch alone: its rows (those with a token, for seq_mean) and tokens
        rows = float((given.sum(dim=-1) > 0).sum()) if config.loss_agg == "seq_mean" else float(logp.shape[0])
        normalizer = loss_normalizer(config, rows, lambda: float(mask.sum()))
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
        valid, offered = mask.sum().clamp(min=1.0), given.sum().clamp(min=1.0)
        clipped_frac = (((ratio < 1 - config.clip_low) | (ratio > 1 + config.clip_high)).to(mask.dtype) * mask)
        rho = torch.exp(log_w)
        stats = {
            "ppo_actor/loss": loss.detach(),
            "ppo_actor/importance_weight": (ratio * mask).sum() / valid,
            "ppo_actor/clip_ratio": clipped_frac.sum() / valid,
            "ppo_actor/behave_imp_weight": (weight * mask).sum() / valid,
            VALID_TOKENS: mask.sum(),
            "ppo_actor/kl": kl_value,
            "mismatch/k3_kl": ((rho - 1 - log_w) * given).sum() / offered,
            "mismatch/chi2": ((rho - 1).square() * given).sum() / offered,
            "mismatch/masked_fraction": ((given - mask) * given).sum() / offered,
            "mismatch/truncated_fraction": (truncated * given).sum() / offered,
        }
    return LossOutput(loss, stats)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of ``values`` over its ``mask``ed tokens ([batch, 1]; 0 for an empty row)."""
    return (values * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)


def behaviour_weight(log_w: torch.Tensor, mask: torch.Tensor,
                     config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the weight each token's loss is multiplied by, the mask after the correction, which tokens were
    truncated) for log w = log π_prox − log π_behav (detached) at ``config.correction_level``; see the
    module docstring."""
    if config.correction_level == CorrectionLevel.SEQUENCE:
        log_w = (log_w * mask).sum(dim=-1, keepdim=True).expand_as(log_w)
    elif config.correction_level == CorrectionLevel.GEOMETRIC:
        log_w = sequence_mean(log_w, mask).expand_as(log_w)
    weight = torch.exp(log_w)
    high, low = config.behavior_imp_cap, config.behavior_imp_low
    none = torch.zeros_like(mask)
    if config.correction == CorrectionMode.TRUNCATE:
        if high is None:
            return weight, mask, none
        truncated = (weight > high).to(mask.dtype)
        return weight.clamp(max=high), mask, truncated
    keep = torch.ones_like(mask)
    if high is not None:
        keep = keep * (weight <= high).to(mask.dtype)
    if low is not None:
        keep = keep * (weight >= low).to(mask.dtype)
    return weight, mask * keep, none


def trust_ratio(logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """r = π_θ / π_prox per token, or GSPO's sequence ratio in its token form (module docstring)."""
    log_r = logp - prox_logp
    if level == RatioLevel.TOKEN:
        return torch.exp(log_r)
    return torch.exp(sequence_mean(log_r, mask).detach() + log_r - log_r.detach())


def behaviour_gap(prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                  fresh_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ fresh · |log π_prox − log π_behav|, Σ fresh) over tokens sampled by the weights π_prox is
    computed with (version lag 0), as 0-dim tensors. There the two log-probs differ only by numerics
    (≈ 1e-6 in float32, ≈ 1e-2 in bf16); a large mean means the engine is not sampling from the
    trainer's policy."""
    fresh = fresh_mask.to(prox_logp.dtype)
    return ((prox_logp.detach() - behav_logp).abs() * fresh).sum(), fresh.sum()


MISMATCH_STATS = ("mismatch/k3_kl", "mismatch/chi2", "mismatch/masked_fraction", "mismatch/truncated_fraction")

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
    mismatch: dict[str, list[float]] = field(default_factory=dict)  # the loss's mismatch/* stats, by step
    _warned_at: int | None = None

    def observe(self, step: int, stats: dict[str, float]) -> None:
        for key in MISMATCH_STATS:
            if key in stats and not math.isnan(stats[key]):
                self.mismatch.setdefault(key, []).append(stats[key])
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

    def summary(self) -> dict[str, float | dict[str, float] | None]:
        """The gap's mean and max over the steps, and ``mismatch``: each loss diagnostic's mean over them."""
        return {"behav_logp_gap_mean": round(sum(self.values) / len(self.values), 6) if self.values else None,
                "behav_logp_gap_max": round(max(self.values), 6) if self.values else None,
                "mismatch": {key.removeprefix("mismatch/") + "_mean": round(sum(v) / len(v), 6)
                             for key, v in self.mismatch.items() if v}}
