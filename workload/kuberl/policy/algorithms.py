"""Algorithms as configuration of one objective: advantages, loss aggregation, sample filtering.

Every algorithm below uses the same decoupled-PPO loss (``loss.py``); they differ only in

* the advantage estimator (per group of G samples of one prompt, rewards r₁…r_G):
  - ``grpo``, ``dapo``: Aᵢ = (rᵢ − mean(r)) / (std(r) + ε)
  - ``drgrpo``:        Aᵢ = rᵢ − mean(r)                      (no std scaling)
  - ``rloo``:          Aᵢ = rᵢ − mean_{j≠i} rⱼ = G/(G−1) · (rᵢ − mean(r))
  - ``reinforce_pp``:  Aᵢ = rᵢ − mean(r), then whitened over the whole batch
  - ``ppo``:           none here — a learned critic's GAE gives every token its own advantage when
                       the trainer trains (:mod:`.critic`); rows carry 0 until then
* the loss aggregation: ``token_mean`` (Σ over tokens / valid tokens in the batch) or, for
  Dr.GRPO, ``seq_sum_const`` (Σ over tokens / (batch size · max new tokens));
* DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..api.algorithm import (
    AlgorithmName,
    ClipAnchor,
    CorrectionLevel,
    CorrectionMode,
    LearningRateSchedule,
    RatioLevel,
)
from ..rollout.types import Group, Trajectory

ADVANTAGE = {AlgorithmName.GRPO: "group_norm", AlgorithmName.DAPO: "group_norm", AlgorithmName.DRGRPO: "group_center",
             AlgorithmName.RLOO: "rloo", AlgorithmName.REINFORCE_PP: "batch_whiten", AlgorithmName.PPO: "critic"}


@dataclass(frozen=True)
class AlgorithmConfig:
    name: AlgorithmName
    group_size: int
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    behavior_imp_cap: float | None = 5.0  # the upper bound on w (algorithm.behaviorImpCap)
    max_new_tokens: int = 1024
    correction: CorrectionMode = CorrectionMode.MASK  # how w enters the loss (loss.py)
    correction_level: CorrectionLevel = CorrectionLevel.TOKEN
    behavior_imp_low: float | None = None  # mask: the lower bound on w
    ratio_level: RatioLevel = RatioLevel.TOKEN  # token (PPO) or sequence (GSPO)
    clip_anchor: ClipAnchor = ClipAnchor.PROXIMAL  # what the ratio is taken against (resolved: never auto)

    def __post_init__(self) -> None:
        """The spec's enums as they are; their values (a test's, a benchmark's) become them."""
        for field, allowed in (("name", AlgorithmName), ("correction", CorrectionMode),
                               ("correction_level", CorrectionLevel), ("ratio_level", RatioLevel),
                               ("clip_anchor", ClipAnchor)):
            value = getattr(self, field)
            if value not in {m.value for m in allowed}:
                raise ValueError(f"{field} {value!r}; allowed: {', '.join(m.value for m in allowed)}")
            object.__setattr__(self, field, allowed(value))

    @property
    def loss_agg(self) -> str:
        """``seq_sum_const`` (Dr.GRPO), ``seq_mean`` (GSPO: each sequence's token mean, averaged over
        the batch's sequences) or ``token_mean``."""
        if self.name == "drgrpo":
            return "seq_sum_const"
        return "seq_mean" if self.ratio_level == RatioLevel.SEQUENCE else "token_mean"

    @property
    def dynamic_sampling(self) -> bool:
        return self.name == "dapo"


def advantages(rewards: torch.Tensor, config: AlgorithmConfig, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages for ``rewards`` of shape [num_groups, group_size]."""
    if rewards.dim() != 2 or rewards.shape[1] != config.group_size:
        raise ValueError(f"rewards must be [groups, {config.group_size}], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    kind = ADVANTAGE[config.name]
    if kind == "critic":
        return torch.zeros_like(rewards)
    if kind == "group_norm":
        return (rewards - mean) / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    if kind == "group_center":
        return rewards - mean
    if kind == "rloo":
        g = config.group_size
        if g < 2:
            raise ValueError("rloo needs groupSize ≥ 2")
        return (rewards - mean) * g / (g - 1)
    centered = rewards - mean  # batch_whiten
    return (centered - centered.mean()) / (centered.std(unbiased=False) + eps)


def keep_group(rewards: torch.Tensor, config: AlgorithmConfig) -> bool:
    """DAPO dynamic sampling: a group that cannot teach anything (all rewards equal) is dropped."""
    return not config.dynamic_sampling or bool(rewards.max() > rewards.min())


def build_batch(groups: list[Group], config: AlgorithmConfig) -> tuple[list[Trajectory], list[float], int]:
    """Flatten groups into trajectories with advantages (computed over the whole batch at once, as
    REINFORCE++'s batch whitening requires); DAPO drops groups that teach nothing."""
    rewards = torch.tensor([[t.reward for t in g.trajectories] for g in groups], dtype=torch.float32)
    kept = [i for i in range(len(groups)) if keep_group(rewards[i], config)]
    if not kept:
        return [], [], len(groups)
    trajs = [t for i in kept for t in groups[i].trajectories]
    return trajs, advantages(rewards[kept], config).flatten().tolist(), len(groups) - len(kept)


def learning_rate_at(step: int, total_steps: int, base: float, schedule: LearningRateSchedule, min_ratio: float,
                     warmup_steps: int = 0) -> float:
    """The learning rate of training step ``step`` (0-based) of ``total_steps``:
    base · min(1, (step + 1) / W) · (m + (1 − m) · d(x)), W = ``warmup_steps``, x = (step − W) / (total_steps − W)
    clamped to [0, 1], m = ``min_ratio``, d(x) = 1 (``constant``), 1 − x (``linear``) or (1 + cos πx) / 2
    (``cosine``): a linear ramp over the first W steps (AdamW's first updates, its moments fresh, move every
    weight by ≈ the full rate whatever its gradient), then the schedule over the steps left. A function of the
    step alone, so a resumed run continues the schedule exactly where the checkpoint left it."""
    ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    x = min(max((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0), 1.0)
    decay = {LearningRateSchedule.CONSTANT: 1.0, LearningRateSchedule.LINEAR: 1.0 - x,
             LearningRateSchedule.COSINE: (1.0 + math.cos(math.pi * x)) / 2}
    if schedule not in decay:
        raise ValueError(f"algorithm.learningRateSchedule {schedule!r}; allowed: {', '.join(decay)}")
    return base * ramp * (min_ratio + (1.0 - min_ratio) * decay[schedule])
