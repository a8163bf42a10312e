"""``spec.algorithm``: the objective a run trains with — the advantage estimator, the PPO clip, the
off-policy corrections, the learning rate and, for ``ppo``, the learned critic."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from .base import ApiModel, Positive, cel


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    DRGRPO = "drgrpo"
    DAPO = "dapo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_pp"
    PPO = "ppo"


class CorrectionMode(StrEnum):
    MASK = "mask"  # w applied; tokens or sequences whose w leaves [low, high] masked out (MIS, IcePop)
    TRUNCATE = "truncate"  # w → min(w, high), nothing masked (TIS)


class CorrectionLevel(StrEnum):
    TOKEN = "token"  # each token's own w
    SEQUENCE = "sequence"  # the sequence's product Π_t w_t
    GEOMETRIC = "geometric"  # the sequence's geometric mean exp(mean_t log w_t)


class RatioLevel(StrEnum):
    TOKEN = "token"  # PPO: r_t = π_θ / π_prox per token
    SEQUENCE = "sequence"  # GSPO: s = exp(mean_t log(π_θ / π_prox)) per sequence, clipped as a whole


class ClipAnchor(StrEnum):
    """What the PPO ratio is taken against (``kuberl.policy.loss``)."""

    AUTO = "auto"  # behavior with one mini-batch and token-level ratio and correction, else proximal
    PROXIMAL = "proximal"  # decoupled PPO: r = π_θ / π_prox, the weights at the start of the step
    BEHAVIOR = "behavior"  # coupled PPO: r = π_θ / π_behav, the weights that sampled the token


class LearningRateSchedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class ClipSpec(ApiModel):
    """The PPO trust region: the ratio π_θ / π_prox is clipped to [1 − low, 1 + high]."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(("self.high >= self.low", "clip.high must be >= clip.low"))
    }
    low: float = Field(0.2, ge=0, le=1, description="ε: ratio clipped below at 1 − low")
    high: float = Field(0.28, ge=0, description="ε_high: ratio clipped above at 1 + high")
    dual: float | None = Field(None, gt=1, description="dual-clip constant c (> 1); off if unset")
    anchor: ClipAnchor = Field(
        ClipAnchor.AUTO,
        description="the policy the ratio is taken against: proximal (π_prox, the weights at the start of the step: "
                    "decoupled PPO, whose clip binds only from the second mini-batch on) or behavior (π_behav, the "
                    "weights that sampled the token: the clip stops pushing tokens the policy already moved by more "
                    "than the clip since sampling); auto: behavior when miniBatches is 1 (π_prox = π_θ there, so "
                    "a proximal clip never binds) and ratio and importanceSampling.level are token, else proximal")

    @model_validator(mode="after")
    def _high_not_below_low(self) -> ClipSpec:
        if self.high < self.low:
            raise ValueError(f"clip.high ({self.high}) must be >= clip.low ({self.low})")
        return self


class ImportanceSamplingSpec(ApiModel):
    """How the behaviour importance weight w = π_prox / π_behav (the trainer's policy at the step's
    start over the engine's that sampled the token: staleness and numerics) enters the loss."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(
            ("self.mode != 'truncate' || !has(self.low)", "importanceSampling.low: truncate has no lower bound"))
    }
    mode: CorrectionMode = Field(
        CorrectionMode.MASK, description="mask (MIS; IcePop is a two-sided token mask): w kept, what leaves "
                                         "[low, behaviorImpCap] masked; truncate (TIS): min(w, behaviorImpCap)")
    level: CorrectionLevel = Field(CorrectionLevel.TOKEN, description="w per token, per sequence (the product) or "
                                                                       "the sequence's geometric mean")
    low: float | None = Field(None, gt=0, description="mask: below this w is masked out (the upper bound is "
                                                      "algorithm.behaviorImpCap)")

    @model_validator(mode="after")
    def _bounds(self) -> ImportanceSamplingSpec:
        if self.mode == CorrectionMode.TRUNCATE and self.low is not None:
            raise ValueError("importanceSampling.low: truncate has no lower bound (mode mask has)")
        return self


class CriticSpec(ApiModel):
    """``ppo``'s value model: the policy's transformer (a copy, from the same weights) with a scalar head
    that starts at zero, trained beside the policy with its own AdamW (:mod:`kuberl.policy.critic`)."""

    learning_rate: float = Field(1.0e-5, gt=0, description="the value model's AdamW learning rate; it follows "
                                                           "algorithm.learningRateSchedule as the policy's does")
    gamma: float = Field(1.0, ge=0, le=1, description="γ: the discount from one generated token to the next")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="λ of GAE: 1 is the Monte-Carlo return minus the value, "
                                                           "0 the one-token TD error")
    value_clip: float | None = Field(0.2, gt=0, description="ε_v: the value loss also takes the new value clipped to "
                                                            "within ε_v of the step's old one, whichever is worse "
                                                            "(PPO's clipped value loss); null: unclipped")


class AlgorithmSpec(ApiModel):
    """The RL algorithm and its optimisation: advantages, batch, learning rate and schedule, the PPO objective's clip,
    corrections and critic."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(
            ("self.batchSize % self.groupSize == 0", "batchSize must be a multiple of groupSize"),
            ("!has(self.importanceSampling) || !has(self.importanceSampling.low) || !has(self.behaviorImpCap) "
             "|| self.importanceSampling.low < self.behaviorImpCap", "importanceSampling.low must be < behaviorImpCap"),
            ("!has(self.warmupSteps) || !has(self.maxSteps) || self.warmupSteps < self.maxSteps",
             "warmupSteps must be < maxSteps"),
            ("!has(self.critic) || self.name == 'ppo'", "critic: only algorithm.name ppo trains a critic"),
            ("self.name != 'ppo' || !has(self.ratio) || self.ratio == 'token'",
             "ratio: sequence (GSPO) with ppo: a critic's advantages are per token; use ratio token"),
            ("!has(self.clip) || !has(self.clip.anchor) || self.clip.anchor != 'behavior' || ((!has(self.ratio) || "
             "self.ratio == 'token') && (!has(self.importanceSampling) || !has(self.importanceSampling.level) || "
             "self.importanceSampling.level == 'token'))",
             "clip.anchor behavior needs ratio token and importanceSampling.level token"),
        )
    }
    name: AlgorithmName = Field(AlgorithmName.GRPO, description="how advantages are computed: grpo (reward minus its "
                                                                "group's mean, over the group's std), drgrpo (minus "
                                                                "the mean only), dapo (grpo, groups without reward "
                                                                "variance left out), rloo (minus the other samples' "
                                                                "mean), reinforce_pp (whitened over the batch), ppo "
                                                                "(GAE over a critic)")
    group_size: Positive = Field(8, description="samples per prompt")
    batch_size: Positive = Field(256, description="trajectories per training step")
    learning_rate: float = Field(1.0e-6, gt=0, description="the policy's AdamW learning rate (the schedule's peak)")
    learning_rate_schedule: LearningRateSchedule = Field(
        LearningRateSchedule.CONSTANT,
        description="the learning rate at step s of S = maxSteps, after W = warmupSteps: learningRate · (m + "
                    "(1 − m) · d((s − W) / (S − W))), d(x) = 1 (constant), 1 − x (linear) or (1 + cos πx) / 2 "
                    "(cosine), m = minLearningRateRatio")
    min_learning_rate_ratio: float = Field(
        0.1, ge=0, le=1, description="m: where linear and cosine schedules end, as a share of learningRate")
    warmup_steps: int = Field(
        0, ge=0, description="W: over the first W steps the rate rises linearly, step s at (s + 1) / W of the "
                             "schedule's; AdamW's first updates, its moments fresh, move every weight by about the "
                             "full rate whatever its gradient (with stale batches that set the reward back)")
    clip: ClipSpec = Field(default_factory=ClipSpec, description="the PPO ratio's clip range (clip-higher when high > "
                                                                 "low) and dual clip")
    kl_coef: float = Field(
        0.0, ge=0, description="weight of KL(π_θ ‖ π_ref) in the loss; π_ref is the policy RL starts from"
    )
    max_steps: Positive = Field(1000, description="training steps (optimizer steps over batchSize trajectories); the "
                                                  "run succeeds after the last")
    mini_batches: Positive = Field(
        1, description="optimizer updates per batch; above 1, π_prox is recomputed by an extra forward pass"
    )
    behavior_imp_cap: float | None = Field(
        5.0, gt=0, description="the upper bound on w = π_prox/π_behav: above it tokens (or sequences) are masked, "
                               "or w is truncated to it (importanceSampling.mode); null: none"
    )
    importance_sampling: ImportanceSamplingSpec = Field(default_factory=ImportanceSamplingSpec)
    ratio: RatioLevel = Field(RatioLevel.TOKEN, description="token (PPO) or sequence (GSPO: one length-normalised "
                                                             "ratio per sequence, clipped by clip.low/high)")
    routing_replay: bool = Field(False, description="R3, for a mixture of experts: the engine returns the experts it "
                                                    "chose at every position, and the trainer routes each token "
                                                    "through them (the gate weights its own), so the routers' "
                                                    "disagreements leave the off-policy correction alone")
    critic: CriticSpec | None = Field(None, description="ppo only: the value model behind its GAE advantages "
                                                        "(defaults apply when ppo leaves it out)")

    @property
    def clip_anchor(self) -> ClipAnchor:
        """``clip.anchor`` resolved: ``auto`` is behavior with one mini-batch and token-level ratio and
        correction (where a proximal clip never binds), else proximal."""
        if self.clip.anchor != ClipAnchor.AUTO:
            return self.clip.anchor
        token_level = self.ratio == RatioLevel.TOKEN and self.importance_sampling.level == CorrectionLevel.TOKEN
        return ClipAnchor.BEHAVIOR if self.mini_batches == 1 and token_level else ClipAnchor.PROXIMAL

    @property
    def value_model(self) -> CriticSpec | None:
        """The critic ``ppo`` trains (the spec's, or the defaults); None for the critic-free algorithms."""
        return (self.critic or CriticSpec()) if self.name == AlgorithmName.PPO else None

    @model_validator(mode="after")
    def _batch_holds_whole_groups(self) -> AlgorithmSpec:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batchSize ({self.batch_size}) must be a multiple of groupSize ({self.group_size})"
            )
        if self.ratio == RatioLevel.SEQUENCE and self.name == AlgorithmName.DRGRPO:
            raise ValueError("ratio: sequence (GSPO) averages over sequences; drgrpo's loss is a sum over a "
                             "constant token count: use grpo, dapo, rloo or reinforce_pp with it")
        if self.critic is not None and self.name != AlgorithmName.PPO:
            raise ValueError(f"critic: only algorithm.name ppo trains a critic; name is {self.name}")
        if self.name == AlgorithmName.PPO and self.ratio == RatioLevel.SEQUENCE:
            raise ValueError("ratio: sequence (GSPO) with ppo: a critic's advantages are per token; use ratio token")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmupSteps ({self.warmup_steps}) must be < maxSteps ({self.max_steps})")
        if self.clip.anchor == ClipAnchor.BEHAVIOR and (self.ratio != RatioLevel.TOKEN or
                                                        self.importance_sampling.level != CorrectionLevel.TOKEN):
            raise ValueError("clip.anchor behavior takes each token's ratio against the policy that sampled it: it "
                             "needs ratio token and importanceSampling.level token (or clip.anchor proximal)")
        low = self.importance_sampling.low
        if low is not None and self.behavior_imp_cap is not None and low >= self.behavior_imp_cap:
            raise ValueError(f"importanceSampling.low ({low}) must be < behaviorImpCap ({self.behavior_imp_cap})")
        return self

