"""The decoupled PPO loss and the advantage estimators, against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kuberl.policy.algorithms import AlgorithmConfig, advantages, keep_group, learning_rate_at
from kuberl.policy.loss import ppo_loss


def cfg(name="grpo", **kw):
    return AlgorithmConfig(name=name, group_size=kw.pop("group_size", 2), **kw)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_on_policy_loss_is_minus_mean_advantage():
    logp = t([-1.0, -2.0], [-0.5, -0.5])
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    out = ppo_loss(logp, logp, logp, adv, torch.ones(2, 2), cfg())
    # r = 1, w = 1: loss = Σ −A over 4 tokens / 4 = (−1 −1 +0.5 +0.5)/4
    assert out.loss.item() == pytest.approx(-0.25)


def test_clip_higher_and_behaviour_weight_by_hand():
    config = cfg(clip_low=0.2, clip_high=0.28, behavior_imp_cap=None)
    prox = t([0.0, 0.0, 0.0])
    logp = torch.log(t([1.5, 0.5, 1.1]))       # r = 1.5, 0.5, 1.1
    behav = torch.log(t([0.5, 1.0, 1.0]))      # w = 2, 1, 1
    adv = torch.tensor([2.0], dtype=torch.float64)
    out = ppo_loss(logp, prox, behav, adv, torch.ones(1, 3), config)
    # A > 0: ℓ = max(−A r, −A clip(r)) = −A·min(r, 1.28) for r > 1; for r = 0.5 → max(−1, −1.6) = −1
    expected = (2 * -2 * 1.28 + 1 * -1.0 + 1 * -2 * 1.1) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert float(out.stats["ppo_actor/clip_ratio"]) == pytest.approx(2 / 3)


def test_negative_advantage_and_dual_clip():
    prox = t([0.0])
    logp = torch.log(t([5.0]))  # r = 5 with A = −1 → ℓ = max(5, 1.28) = 5; dual clip c = 3 → 3
    adv = torch.tensor([-1.0], dtype=torch.float64)
    assert ppo_loss(logp, prox, prox, adv, torch.ones(1, 1), cfg(behavior_imp_cap=None)).loss.item() == pytest.approx(5)
    dual = ppo_loss(logp, prox, prox, adv, torch.ones(1, 1), cfg(dual_clip=3.0, behavior_imp_cap=None))
    assert dual.loss.item() == pytest.approx(3.0)


def test_truncated_importance_sampling_cuts_the_weight_and_masks_nothing():
    """TIS: w = 0.5, 10 with C = 2 → weights 0.5 and 2, both tokens kept; on-policy r = 1, A = 1."""
    prox = t([0.0, 0.0])
    behav = torch.log(t([2.0, 0.1]))  # w = π_prox / π_behav = 0.5, 10
    out = ppo_loss(prox, prox, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2),
                   cfg(correction="truncate", behavior_imp_cap=2.0))
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert float(out.stats["ppo_actor/valid_tokens"]) == 2
    assert float(out.stats["mismatch/truncated_fraction"]) == pytest.approx(0.5)
    assert float(out.stats["mismatch/masked_fraction"]) == 0


def test_a_two_sided_token_mask_drops_tokens_on_either_side():
    """Token MIS / IcePop: w = 0.25, 1, 4 with [0.5, 2] keeps only the middle token, w = 1."""
    prox = t([0.0, 0.0, 0.0])
    behav = torch.log(t([4.0, 1.0, 0.25]))
    out = ppo_loss(prox, prox, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3),
                   cfg(behavior_imp_low=0.5, behavior_imp_cap=2.0))
    assert out.loss.item() == pytest.approx(-1.0)
    assert float(out.stats["mismatch/masked_fraction"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("level", "weights"), [("sequence", (2.0 * 3.0, 0.5 * 1.0)),
                                                ("geometric", (math.sqrt(6.0), math.sqrt(0.5)))])
def test_sequence_level_weights_mask_whole_sequences(level, weights):
    """Row 1: w = 2, 3 → Π = 6 (masked at high 5) or √6 (kept); row 2: w = 0.5, 1 → 0.5 or √0.5. Each kept
    token's loss is −A · r · (its row's weight), r = 1."""
    prox = t([0.0, 0.0], [0.0, 0.0])
    behav = torch.log(t([0.5, 1 / 3], [2.0, 1.0]))
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = ppo_loss(prox, prox, behav, adv, torch.ones(2, 2), cfg(correction_level=level, behavior_imp_cap=5.0))
    kept = [w for w in weights if w <= 5.0]
    assert out.loss.item() == pytest.approx(-sum(2 * w for w in kept) / (2 * len(kept)))
    assert float(out.stats["mismatch/masked_fraction"]) == pytest.approx(1 - len(kept) / 2)


def test_gspo_clips_the_length_normalised_sequence_ratio_and_averages_over_sequences():
    """GSPO: row 1 has log r = log 1.2, log 1.0 → s = √1.2 ≈ 1.095 (inside [0.9996, 1.0004]? no: clipped);
    row 2 has r = 1 everywhere → s = 1. Loss = mean over sequences of −A·clip(s) (A > 0 takes the min).
    Gradient: row 2's tokens each get −A·s / (|y| · sequences), row 1's none (clipped)."""
    config = cfg(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, behavior_imp_cap=None)
    assert config.loss_agg == "seq_mean"
    prox = t([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    logp = torch.log(t([1.2, 1.0, 1.0], [1.0, 1.0, 1.0])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)  # row 1: two tokens
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = ppo_loss(logp, prox, prox, adv, mask, config)
    s1 = math.sqrt(1.2)
    assert s1 > 1 + 4e-4
    expected = (-1.0 * min(s1, 1 + 4e-4) + -2.0 * 1.0) / 2
    assert out.loss.item() == pytest.approx(expected)
    out.loss.backward()
    assert logp.grad[0].abs().max().item() == 0  # clipped: no gradient
    assert logp.grad[1].tolist() == pytest.approx([-2.0 / (3 * 2)] * 3)


def test_mismatch_diagnostics_by_hand():
    """ρ = π_prox / π_behav = 2 and 0.5: k3 = mean(ρ − 1 − log ρ), χ² = mean((ρ − 1)²)."""
    prox = t([0.0, 0.0])
    behav = torch.log(t([0.5, 2.0]))
    out = ppo_loss(prox, prox, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2),
                   cfg(behavior_imp_cap=None))
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 2
    assert float(out.stats["mismatch/k3_kl"]) == pytest.approx(k3)
    assert float(out.stats["mismatch/chi2"]) == pytest.approx((1 + 0.25) / 2)


def test_the_chi2_estimate_follows_a_small_mismatch_instead_of_its_sampling_noise():
    """Tokens drawn from π_behav, π_prox a bfloat16-sized perturbation of it (χ² ≈ 1e-4, computed exactly
    over the vocabulary): over 2,000 tokens the estimate is within a factor 2 of the true χ² for every
    seed. (mean(ρ²) − 1 carries 2 · mean(ρ − 1), noise ≈ 2σ(ρ)/√N ≈ 4e-4 here: it strays by several
    times χ², and below zero.)"""
    generator = torch.Generator().manual_seed(0)
    behav_logits = torch.randn(64, generator=generator, dtype=torch.float64) * 2
    prox_logits = behav_logits + 0.01 * torch.randn(64, generator=generator, dtype=torch.float64)
    behav_p, prox_p = behav_logits.softmax(-1), prox_logits.softmax(-1)
    true_chi2 = float(((prox_p / behav_p) ** 2 * behav_p).sum() - 1)
    assert 2e-5 < true_chi2 < 5e-4
    for seed in range(8):
        tokens = torch.multinomial(behav_p, 2000, replacement=True,
                                   generator=torch.Generator().manual_seed(seed)).view(1, -1)
        prox, behav = prox_p.log()[tokens], behav_p.log()[tokens]
        out = ppo_loss(prox, prox, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones_like(prox),
                       cfg(behavior_imp_cap=None))
        assert 0.5 * true_chi2 < float(out.stats["mismatch/chi2"]) < 2 * true_chi2, seed


def test_behaviour_cap_masks_too_off_policy_tokens():
    prox = t([0.0, 0.0])
    behav = torch.log(t([0.1, 1.0]))  # w = 10 (masked with cap 5), 1
    out = ppo_loss(prox, prox, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), cfg())
    assert out.loss.item() == pytest.approx(-1.0)  # only the second token, N = 1
    assert float(out.stats["ppo_actor/valid_tokens"]) == 1


def test_mask_and_drgrpo_constant_normaliser():
    logp = t([-1.0, -1.0, -1.0])
    mask = t([1.0, 1.0, 0.0])
    adv = torch.tensor([1.0], dtype=torch.float64)
    assert ppo_loss(logp, logp, logp, adv, mask, cfg()).loss.item() == pytest.approx(-1.0)
    out = ppo_loss(logp, logp, logp, adv, mask, cfg("drgrpo", max_new_tokens=8))
    assert out.loss.item() == pytest.approx(-2 / 8)


def test_kl_term_k3():
    logp = torch.log(t([0.5]))
    ref = torch.log(t([0.25]))
    out = ppo_loss(logp, logp, logp, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), cfg(kl_coef=0.1),
                   ref_logp=ref)
    k3 = 0.5 - math.log(0.5) - 1
    assert out.loss.item() == pytest.approx(0.1 * k3)


def test_gradient_flows_only_through_current_policy():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    behav = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    ppo_loss(logp, logp.detach(), behav, adv, torch.ones(1, 2), cfg()).loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.5, dtype=torch.float64))
    assert behav.grad is None or torch.all(behav.grad == 0)


def test_advantage_estimators_by_hand():
    r = t([1.0, 0.0, 0.0, 1.0])
    g = cfg("grpo", group_size=4)
    assert torch.allclose(advantages(r, g), t([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(advantages(r, cfg("drgrpo", group_size=4)), t([0.5, -0.5, -0.5, 0.5]))
    # RLOO: r_i − mean of the other three
    assert torch.allclose(advantages(r, cfg("rloo", group_size=4)), t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    batch = t([1.0, 0.0], [1.0, 1.0])
    rpp = advantages(batch, cfg("reinforce_pp", group_size=2))
    assert rpp.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert rpp.std(unbiased=False).item() == pytest.approx(1, abs=1e-4)


def test_dapo_dynamic_sampling():
    assert not keep_group(t([1.0, 1.0]), cfg("dapo"))
    assert keep_group(t([1.0, 0.0]), cfg("dapo"))
    assert keep_group(t([1.0, 1.0]), cfg("grpo"))


def test_batch_advantages_whiten_over_the_whole_batch_and_dapo_filters():
    from kuberl.policy.algorithms import build_batch
    from kuberl.rollout.types import Group, Trajectory

    def group(*rewards):
        return Group([Trajectory([1], [2], [0.0], [0], r) for r in rewards])

    trajs, advs, dropped = build_batch([group(1, 0), group(1, 1), group(0, 0)], cfg("reinforce_pp"))
    # centred per group: [.5, -.5, 0, 0, 0, 0]; batch std = sqrt(.5/6) → ±√3, not ±1 per group
    assert advs == pytest.approx([math.sqrt(3), -math.sqrt(3), 0, 0, 0, 0], rel=1e-4)
    assert len(trajs) == 6 and dropped == 0
    trajs, advs, dropped = build_batch([group(1, 0), group(1, 1)], cfg("dapo"))
    assert len(trajs) == 2 and dropped == 1 and advs == pytest.approx([1, -1], rel=1e-4)


def test_learning_rate_schedules_by_hand():
    assert [learning_rate_at(s, 100, 1e-3, "constant", 0.1) for s in (0, 50, 99)] == [1e-3] * 3
    assert learning_rate_at(0, 100, 1e-3, "linear", 0.1) == pytest.approx(1e-3)
    assert learning_rate_at(50, 100, 1e-3, "linear", 0.1) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate_at(25, 100, 1e-3, "cosine", 0.0) == pytest.approx(1e-3 * (1 + math.sqrt(0.5)) / 2)
    assert learning_rate_at(100, 100, 1e-3, "cosine", 0.2) == pytest.approx(2e-4)  # the floor, not below
    assert learning_rate_at(500, 100, 1e-3, "linear", 0.2) == pytest.approx(2e-4)  # steps past the end stay there
    cosine = [learning_rate_at(s, 40, 1.0, "cosine", 0.1) for s in range(41)]
    assert all(a >= b for a, b in itertools.pairwise(cosine))  # never rises
    with pytest.raises(ValueError, match="learningRateSchedule"):
        learning_rate_at(0, 10, 1.0, "step", 0.1)


def test_a_warm_up_ramps_the_rate_then_the_schedule_runs_over_the_steps_left():
    ramp = [learning_rate_at(s, 110, 1e-3, "linear", 0.0, warmup_steps=10) for s in range(10)]
    assert ramp == pytest.approx([1e-4 * (s + 1) for s in range(10)])  # step 0 already trains, at 1/W
    assert learning_rate_at(10, 110, 1e-3, "linear", 0.0, warmup_steps=10) == pytest.approx(1e-3)  # the peak
    assert learning_rate_at(60, 110, 1e-3, "linear", 0.0, warmup_steps=10) == pytest.approx(5e-4)  # half of 100 left
    assert learning_rate_at(110, 110, 1e-3, "cosine", 0.1, warmup_steps=10) == pytest.approx(1e-4)  # ends at m
    constant = [learning_rate_at(s, 50, 1.0, "constant", 0.1, warmup_steps=5) for s in range(50)]
    assert constant[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]) and set(constant[5:]) == {1.0}


def test_a_behavior_anchored_clip_binds_with_one_mini_batch_and_leaves_the_rest_of_the_gradient_alone():
    """One mini-batch: π_prox = sg(π_θ), so a proximal clip never binds and each token's gradient is
    w·A·∇log π. Anchored to π_behav, the ratio π_θ / π_behav = w: the same gradient where w lies inside
    the clip, none where the policy already moved the token past it in the advantage's direction (w = 1.5
    with A > 0; w = 0.6 with A < 0), and the weight the cap masks (w = 6) stays masked."""
    behav = torch.log(t([1 / 1.5, 1 / 1.1, 1 / 0.6, 1 / 6.0]))  # w = π_θ / π_behav = 1.5, 1.1, 0.6, 6 at θ
    adv = t([1.0, 1.0, -1.0, 1.0])
    mask = torch.ones(1, 4, dtype=torch.float64)

    def grads(anchor: str) -> tuple[list[float], float]:
        logp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
        out = ppo_loss(logp, logp.detach(), behav, adv, mask, cfg(clip_anchor=anchor, behavior_imp_cap=5.0))
        out.loss.backward()
        return [round(g, 6) for g in logp.grad[0].tolist()], float(out.stats["ppo_actor/clip_ratio"])

    proximal, proximal_clipped = grads("proximal")
    behavior, behavior_clipped = grads("behavior")
    assert proximal == [round(-1.5 / 3, 6), round(-1.1 / 3, 6), round(0.6 / 3, 6), 0.0] and proximal_clipped == 0
    assert behavior == [0.0, round(-1.1 / 3, 6), 0.0, 0.0]  # clipped: 1.5 > 1.28 with A > 0, 0.6 < 0.8 with A < 0
    assert behavior_clipped == pytest.approx(2 / 3)


def test_the_anchor_resolves_to_behavior_only_where_a_proximal_clip_cannot_bind():
    from kuberl.api.algorithm import AlgorithmSpec, ClipAnchor

    assert AlgorithmSpec().clip_anchor == ClipAnchor.BEHAVIOR  # one mini-batch
    assert AlgorithmSpec(mini_batches=4).clip_anchor == ClipAnchor.PROXIMAL
    assert AlgorithmSpec(ratio="sequence").clip_anchor == ClipAnchor.PROXIMAL  # GSPO's ratio is per sequence
    assert AlgorithmSpec(mini_batches=4, clip={"anchor": "behavior"}).clip_anchor == ClipAnchor.BEHAVIOR
    with pytest.raises(ValueError, match=r"clip.anchor behavior .* needs ratio token"):
        AlgorithmSpec(ratio="sequence", clip={"anchor": "behavior"})
