"""PPO's learned critic (``kuberl.policy.critic``): GAE against the textbook sum, the clipped value
loss by hand, and on the FSDP2 actor — the GAE advantages are what the policy's update uses, the
value model learns the returns, and it is checkpointed and exported with the policy."""

from __future__ import annotations

import dataclasses
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
from kuberl.policy.critic import (
    CriticConfig,
    discounted_suffix_sums,
    gae,
    packed_values,
    padded_values,
    value_loss,
    value_model,
    whiten,
)
from kuberl.rollout.types import Trajectory
from kuberl.trainer.checkpointing import CheckpointError, TrainerState, load_trainer, save_trainer
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


@pytest.mark.parametrize("c", [0.0, 0.5, 0.95, 1.0])
def test_discounted_suffix_sums_across_blocks(c):
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.zeros_like(x)
    for t in reversed(range(300)):  # y_t = x_t + c · y_{t+1}
        want[:, t] = x[:, t] + (c * want[:, t + 1] if t + 1 < 300 else 0.0)
    for block in (7, 128, 512):  # 300 positions: many blocks, a short last one, one block
        torch.testing.assert_close(discounted_suffix_sums(x, c, block), want)


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


@pytest.mark.slow
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
    save_trainer(actor, TrainerState.capture(25, 25, 0), tmp_path)
    resumed = ppo_actor(lr=1e-6)
    assert load_trainer(resumed, tmp_path).step == 25
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


def test_a_critic_free_checkpoint_does_not_resume_ppo(world_of_one, tmp_path: Path):
    grpo = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), AlgorithmConfig(name="grpo", group_size=4), 1e-2, 1.0)
    save_trainer(grpo, TrainerState.capture(3, 3, 0), tmp_path)
    with pytest.raises(CheckpointError, match=r"spec\.algorithm\.name is ppo but the checkpoint has no critic"):
        load_trainer(ppo_actor(), tmp_path)


PPO_LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}


def _one_ppo_step(rank: int, world: int, port: int, layout: str | None, out: str) -> None:
    """Two ppo steps on six rewarded rows: the FSDP actor (``layout`` None, one rank) or the Megatron
    actor laid out as ``PPO_LAYOUTS[layout]`` with its critic; rank 0 saves the stats and both models."""
    from kuberl.collectives import exit_without_teardown
    from kuberl.fsdp.actor import build_critic
    from kuberl.megatron.actor import MegatronActor
    from kuberl.policy.batch import split

    from .test_megatron import qwen2, random_batch
    from .test_megatron_actor import as_collated_alone, gloo_world

    with gloo_world(rank, world, port):
        batch = random_batch(qwen2().config.vocab_size, seed=6, rows=6)
        batch = dataclasses.replace(batch, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]))
        critic = CriticConfig(learning_rate=1e-3)
        if layout is None:
            actor = FSDPActor.create(qwen2(tied=False), PPO, lr=1e-2, temperature=0.7, critic=critic)
        else:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(**PPO_LAYOUTS[layout])
            actor = MegatronActor.from_hf(qwen2(tied=False), PPO, lr=1e-2, temperature=0.7,
                                          critic=build_critic(qwen2(tied=False), critic, torch.device("cpu")))
        actor.start_critic()  # as the trainer does after an SFT warm-up (the weights are those already)
        data_rank, data_ranks = actor.data_parallel()
        mine = as_collated_alone(split(batch, data_ranks)[data_rank])
        stats = actor.train_step(mine, batch.size)
        stats |= {f"second/{k}": v for k, v in actor.train_step(mine, batch.size).items()}
        result = {"stats": stats, "policy": actor.full_state_dict(), "critic": actor.critic_state_dict()}
        if rank == 0:
            torch.save(result, out)
    exit_without_teardown(0)


@pytest.mark.parametrize("layout", list(PPO_LAYOUTS))
@pytest.mark.slow
def test_megatron_trains_ppo_with_its_critic_as_fsdp_does(tmp_path: Path, layout: str):
    """The same two ppo steps on both backends: the policy's loss, the critic's value loss and both
    models' weights after them (Megatron: tensor-parallel pieces, or two pipeline stages, and an FSDP2 critic over
    its two ranks)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")

    from .workers import FREE_PORT, start_workers

    runs = []
    for name, world in (("fsdp", 1), (layout, 2)):
        start_workers(_one_ppo_step, world, (world, FREE_PORT, None if name == "fsdp" else layout,
                                             str(tmp_path / f"{name}.pt")))
        runs.append(torch.load(tmp_path / f"{name}.pt"))
    fsdp, megatron = runs
    for key in ("ppo_actor/loss", "critic/value_loss", "critic/grad_norm", "second/critic/value_loss",
                "second/critic/grad_norm", "second/ppo_actor/grad_norm"):
        assert megatron["stats"][key] == pytest.approx(fsdp["stats"][key], rel=1e-4), key
    assert fsdp["stats"]["critic/value_loss"] > 0
    from .test_megatron import qwen2

    starts = {"policy": qwen2(tied=False).state_dict(), "critic": value_model(qwen2(tied=False)).state_dict()}
    for model, start in starts.items():
        assert megatron[model].keys() == fsdp[model].keys() == start.keys()
        for name, weights in fsdp[model].items():
            change, other = weights - start[name], megatron[model][name] - start[name]
            # Adam turns float noise in a near-zero gradient into a step of up to lr: the updates as a whole
            assert change.norm() > 0, f"{model} {name} did not train"
            assert (other - change).norm() <= 1e-2 * change.norm(), f"{model} {name}"


def test_the_critic_starts_from_the_policy_rl_starts_from(world_of_one):
    """After the SFT warm-up (here: a few updates) the critic's transformer is the policy's again; its
    head stays zero, so every value is still 0."""
    actor, batch = ppo_actor(), rewarded_batch(8, seed=3)
    grpo_like = AlgorithmConfig(name="grpo", group_size=4, behavior_imp_cap=None)
    policy_only = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), grpo_like, 1e-2, 1.0)
    for _ in range(2):
        policy_only.train_step(dataclasses.replace(batch, advantages=batch.rewards - 0.5), batch.size)
    actor.model.load_state_dict(policy_only.model.state_dict())  # the warmed-up policy
    actor.start_critic()
    policy, critic = actor.full_state_dict(), actor.critic.full_state_dict()
    assert critic.keys() == {k for k in policy if k != "lm_head.weight"} | {"score.weight", "score.bias"}
    assert all(torch.equal(critic[k], policy[k]) for k in critic if not k.startswith("score."))
    assert not critic["score.weight"].any()
    fresh = tiny_qwen2(VOCAB, seed=3).state_dict()
    assert not policy["model.embed_tokens.weight"].equal(fresh["model.embed_tokens.weight"])  # it did move


def test_packed_values_equal_padded_ones():
    model = value_model(tiny_qwen2(VOCAB, seed=3)).eval()
    with torch.no_grad():
        for param in model.score.parameters():
            param.normal_()
        batch = rewarded_batch(10, seed=4)
        padded, packed = padded_values(model, batch), packed_values(model, batch)
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)


def test_a_critic_of_a_model_loaded_from_its_files_starts_as_the_policy(world_of_one, tmp_path: Path):
    """A hub-sized policy is built on ``meta`` and filled from its files after sharding: so is its
    critic, whose head the files lack (zeros) — the load must neither fail on it nor leave it empty."""
    from transformers import AutoModelForCausalLM

    from kuberl.models.meta import is_meta

    saved = tiny_qwen2(VOCAB, seed=3)
    saved.save_pretrained(tmp_path / "model")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(saved.config, dtype=torch.float32)
    assert is_meta(skeleton)
    actor = FSDPActor.create(skeleton, PPO, lr=1e-2, temperature=1.0, weights=tmp_path / "model",
                             critic=CriticConfig())
    critic, files = actor.critic.full_state_dict(), saved.state_dict()
    assert not critic["score.weight"].any() and not critic["score.bias"].any()
    assert all(torch.equal(critic[k], files[k]) for k in critic if not k.startswith("score."))
