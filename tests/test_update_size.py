"""How far a step moved the policy (kuberl.policy.update_size): the update's size read back from AdamW's
state is the change of the weights, and the update's KL is the probe's, before and after the step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import tiny_qwen2
from kuberl.policy.actor import token_logprobs
from kuberl.policy.batch import collate, split
from kuberl.policy.update_size import PROBE_ROWS, adamw_steps, relative_size, update_kl_sums

from .test_actor import CONFIG, trajectories


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(1e-3, 0.3), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999), eps=st.floats(1e-10, 1e-3),
       decay=st.sampled_from([0.0, 0.01, 0.5]), amsgrad=st.booleans(), maximize=st.booleans(),
       steps=st.integers(1, 4), foreach=st.booleans(), seed=st.integers(0, 2**16))
def test_the_update_read_from_adamws_state_is_the_change_of_the_weights(lr, beta1, beta2, eps, decay, amsgrad,
                                                                       maximize, steps, foreach, seed):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=generator)), torch.nn.Parameter(torch.randn(4))]
    frozen = torch.nn.Parameter(torch.randn(2))  # in the optimizer, never given a gradient: never stepped
    optimizer = torch.optim.AdamW([*params, frozen], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=decay,
                                  amsgrad=amsgrad, maximize=maximize, foreach=foreach)
    for _ in range(steps):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    moved = list(adamw_steps(optimizer))
    assert [param for param, _ in moved] == params  # the frozen one is not among them
    for (_, delta), p, old in zip(moved, params, before, strict=True):
        # atol: θ − θ_old rounds to float32 at |θ| ≈ 4 (an ulp there is 4.8e-7)
        torch.testing.assert_close(delta, p.detach() - old, rtol=1e-4, atol=1e-6)


def test_the_update_kl_is_zero_for_the_same_policy_and_counts_only_masked_tokens():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert update_kl_sums(old, old, mask).tolist() == [0.0, 2.0]
    new = old + torch.tensor([[0.3, -0.2, 5.0]])  # the masked token's change counts for nothing
    kl, tokens = update_kl_sums(old, new, mask).tolist()
    r = torch.tensor([0.3, -0.2]).exp()
    assert tokens == 2 and kl == pytest.approx(float((r * r.log() - r + 1).sum()), rel=1e-6) and kl > 0
    assert relative_size(torch.tensor(1.0), torch.tensor(0.0)) == 0


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_a_steps_stats_carry_its_update_size_and_kl(world_of_one, mini_batches):
    """ppo_actor/update_size is ‖θ_after − θ_before‖ / ‖θ_after‖ of the weights themselves (averaged over
    the step's updates), and ppo_actor/update_kl the mean of r·log r − r + 1 over the probe's tokens, from
    log-probs the test reads from the policy before and after."""
    trajs, advs = trajectories(12, seed=4)
    actor = FSDPActor.create(tiny_qwen2(40, seed=5), CONFIG, lr=1e-2, temperature=1.0, mini_batches=mini_batches)
    batch = collate(trajs, advs, 0)
    first_update = split(batch, mini_batches)[0]  # the probe: the first rows of its first micro-batch
    probe = actor._micro_batches(first_update)[0].select(slice(0, PROBE_ROWS)).trimmed()
    trained = [p for group in actor.optimizer.param_groups for p in group["params"]]

    def whole() -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in trained]

    with torch.no_grad():
        old_logp = token_logprobs(actor.model, probe, 1.0)
    before = whole()
    stats = actor.train_step(batch, batch.size)
    after = whole()
    with torch.no_grad():
        new_logp = token_logprobs(actor.model, probe, 1.0)
    change = torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)]).norm()
    whole_step = float(change / torch.cat([a.flatten() for a in after]).norm())
    if mini_batches == 1:  # rel: θ_after − θ_before rounds to float32
        assert stats["ppo_actor/update_size"] == pytest.approx(whole_step, rel=1e-3)
    else:  # the mean of two updates' (‖Δ₁ + Δ₂‖ ≤ ‖Δ₁‖ + ‖Δ₂‖; ‖θ‖ moves by a few % between them)
        assert stats["ppo_actor/update_size"] >= 0.45 * whole_step > 0
    r = (new_logp - old_logp).exp()
    mask = probe.loss_mask
    expected_kl = float(((r * r.log() - r + 1) * mask).sum() / mask.sum())
    assert stats["ppo_actor/update_kl"] == pytest.approx(expected_kl, rel=1e-3) and expected_kl > 0
