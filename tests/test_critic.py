"""PPO's learned critic (``kuberl.policy.critic``): GAE against the textbook sum, the clipped value
loss by hand, and on the FSDP2 actor — the GAE advantages are what the policy's update uses, the
value model learns the returns, and it is checkpointed and exported with the policy."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.api.spec import ExportSpec
from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import chat_tokenizer, tiny_qwen2
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, collate
from kuberl.policy.critic import CriticConfig, gae, value_loss, whiten
from kuberl.rollout.types import Trajectory
from kuberl.trainer.export import export_policy

PPO = AlgorithmConfig(name="ppo", group_size=4, behavior_imp_cap=None)
VOCAB = 40


def textbook_gae(values: list[float], mask: list[int], reward: float, gamma: float,
                 lam: float) -> tuple[list[float], list[float]]:
    """One row, written as the sums: Aₖ = Σ_{j≥k} (γλ)^{j−k} δⱼ over the trained tokens, Rₖ = Aₖ + Vₖ."""
    steps = [t for t, m in enumerate(mask) if m]
    v = [values[t] for t in steps] + [0.0]
    r = [0.0] * (len(steps) - 1) + [reward] if steps else []
    deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(steps))]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for k, t in enumerate(steps):
        adv[t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(steps)))
        ret[t] = adv[t] + v[k]
    return adv, ret


def test_gae_by_hand():
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 0.1]])  # 9: positions that are not steps (prompt, tool output)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    adv, ret = gae(values, torch.tensor([1.0]), mask, gamma=0.5, lam=0.5)
    # δ: 1 − 0.1 = 0.9 | 0.5·0.1 − 0.4 = −0.35 | 0.5·0.4 − 0.2 = 0; A = δ + 0.25 · A_next
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.03125, -0.125, 0.0, 0.9]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.16875, 0.275, 0.0, 1.0]]))
    adv, _ = gae(values, torch.tensor([1.0]), mask, gamma=1.0, lam=1.0)  # Monte Carlo: r − V at every step
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.8, 0.6, 0.0, 0.9]]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-2, 2), st.booleans()), min_size=1, max_size=12), min_size=1,
                max_size=5),
       st.lists(st.floats(-1, 1), min_size=5, max_size=5), st.floats(0, 1), st.floats(0, 1))
def test_gae_equals_the_textbook_sum(rows, rewards, gamma, lam):
    width = max(map(len, rows))
    values = torch.tensor([[v for v, _ in row] + [0.0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[float(m) for _, m in row] + [0.0] * (width - len(row)) for row in rows])
    adv, ret = gae(values, torch.tensor(rewards[:len(rows)]), mask, gamma, lam)
    for i in range(len(rows)):
        want_adv, want_ret = textbook_gae(values[i].tolist(), mask[i].int().tolist(), rewards[i], gamma, lam)
        torch.testing.assert_close(adv[i], torch.tensor(want_adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i], torch.tensor(want_ret), atol=1e-5, rtol=1e-5)


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([[1.0, 0.6]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2, normalizer=2.0)
    # token 1: (1 − 2)² = 1 vs clipped (0.7 − 2)² = 1.69 → 1.69; token 2: 0.6 is within the clip → 0.36
    assert float(loss) == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    assert float(stats["critic/clip_fraction"]) == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 2), clip=None, normalizer=2.0)
    assert float(unclipped) == pytest.approx(0.5 * (1.0 + 0.36) / 2)


def test_whitening_spans_every_micro_batch_and_leaves_the_rest_zero():
    a, b = torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[3.0, 7.0]])
    ma, mb = torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    out = whiten([a, b], [ma, mb])
    kept = torch.tensor([1.0, 2.0, 3.0])
    want = (kept - kept.mean()) / (kept.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(torch.cat([out[0][ma > 0], out[1][mb > 0]]), want)
    assert out[0][0, 1] == 0 and out[1][0, 1] == 0


def rewarded_batch(rows: int, seed: int = 0) -> Batch:
    """Rows of random tokens and lengths, rewards 0 or 1."""
    rng = random.Random(seed)
    trajs = []
    for _ in range(rows):
        out = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(2, 9))]
        trajs.append(Trajectory([2, rng.randrange(4, VOCAB)], out, [-3.0] * len(out), [0] * len(out),
                                reward=float(rng.random() < 0.5)))
    return collate(trajs, [0.0] * rows, 0)


def ppo_actor(lr: float = 1e-2, critic_lr: float = 1e-3) -> FSDPActor:
    return FSDPActor.create(tiny_qwen2(VOCAB, seed=3), PPO, lr=lr, temperature=1.0,
                            critic=CriticConfig(learning_rate=critic_lr))


def weights(actor: FSDPActor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.full_state_dict().items()}


def test_the_policy_update_uses_the_critics_gae_advantages(world_of_one):
    """A fresh critic's values are 0, so with γ = λ = 1 every trained token's advantage is its row's
    reward, whitened over the batch's tokens: PPO's first update must equal a critic-free update given
    exactly those per-token advantages (and differ from one given the rows' raw rewards)."""
    batch = rewarded_batch(12)
    mask = batch.loss_mask
    rewards = batch.rewards.unsqueeze(1) * mask
    expected = whiten([rewards], [mask])[0]
    ppo = ppo_actor()
    ppo.train_step(batch, batch.size)
    given = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), AlgorithmConfig(name="grpo", group_size=4,
                                                                        behavior_imp_cap=None), 1e-2, 1.0)
    given.train_step(Batch(**{**vars(batch), "advantages": expected}), batch.size)
    raw = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), AlgorithmConfig(name="grpo", group_size=4,
                                                                      behavior_imp_cap=None), 1e-2, 1.0)
    raw.train_step(Batch(**{**vars(batch), "advantages": batch.rewards}), batch.size)
    start, one, other, wrong = tiny_qwen2(VOCAB, seed=3).state_dict(), weights(ppo), weights(given), weights(raw)

    def distance(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float((x[n] - y[n]).pow(2).sum()) for n in x))

    update = distance(one, start)
    assert update > 0 and distance(one, other) < 1e-4 * update
    assert distance(one, wrong) > 0.1 * update


def test_the_critic_learns_the_returns_and_survives_a_checkpoint(world_of_one, tmp_path: Path):
    batch = rewarded_batch(16, seed=1)
    actor = ppo_actor(lr=1e-6)  # the policy barely moves: the critic's target stays put
    losses = [actor.train_step(batch, batch.size)["critic/value_loss"] for _ in range(20)]
    assert losses[-1] < 0.2 * losses[0]
    with torch.no_grad():
        values = actor.critic.read_values(actor.critic.model, batch)
    trained = batch.loss_mask > 0
    target = (batch.rewards.unsqueeze(1) * torch.ones_like(batch.loss_mask))[trained]  # γ = λ = 1: R = r
    assert float((values[trained] - target).abs().mean()) < 0.25
    actor.save_shards(tmp_path / "shards")
    resumed = ppo_actor(lr=1e-6)
    resumed.load_shards(tmp_path / "shards")
    with torch.no_grad():
        torch.testing.assert_close(resumed.critic.read_values(resumed.critic.model, batch), values)
    after = [a.train_step(batch, batch.size)["critic/value_loss"] for a in (actor, resumed)]
    assert after[1] == pytest.approx(after[0], rel=1e-5)  # the critic's optimizer state came back too


def test_the_value_model_is_exported_beside_the_policy(world_of_one, tmp_path: Path):
    from transformers import AutoModelForTokenClassification

    actor, batch = ppo_actor(), rewarded_batch(8, seed=2)
    actor.train_step(batch, batch.size)
    done = export_policy(actor, chat_tokenizer(), 1, f"file://{tmp_path}/ckpt/", ExportSpec(dtype="float32"),
                         tmp_path / "staging", None, 0)
    assert done is not None
    exported = next((tmp_path / "ckpt" / "hf").glob("step-*"))
    value = AutoModelForTokenClassification.from_pretrained(exported / "value").eval()
    with torch.no_grad():
        want = actor.critic.read_values(actor.critic.model, batch)
        got = value(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, 0]
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
