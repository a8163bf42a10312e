"""The FSDP2 actor on CPU/gloo: the π_prox shortcut is exact, and data-parallel training equals
single-process training even when ranks hold different row counts and micro-batch counts."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kuberl.api.spec import ModelSource
from kuberl.collectives import exit_without_teardown
from kuberl.fsdp.actor import FSDPActor
from kuberl.models.loading import load_skeleton
from kuberl.models.meta import is_meta
from kuberl.models.tiny import tiny_qwen2
from kuberl.policy.actor import Actor, token_logprobs
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import PASS_COST_TOKENS, collate, micro_batch_count, split
from kuberl.rollout.types import Trajectory

from .workers import FREE_PORT, start_workers

CONFIG = AlgorithmConfig(name="grpo", group_size=4, behavior_imp_cap=None)


def trajectories(n: int, seed: int = 0) -> tuple[list[Trajectory], list[float]]:
    """Prompts and outputs of varied length with slightly off-policy behaviour log-probs."""
    rng = random.Random(seed)
    trajs = []
    for _ in range(n):
        out = [rng.randrange(4, 30) for _ in range(rng.randrange(1, 6))]
        trajs.append(Trajectory([2] + [rng.randrange(4, 30) for _ in range(rng.randrange(2, 8))], out,
                                [rng.uniform(-4.0, -3.0) for _ in out], [0] * len(out)))
    return trajs, [rng.gauss(0.0, 1.0) for _ in trajs]


def weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.full_state_dict().items()}


def test_split_gives_exact_part_count_with_masked_fillers():
    trajs, advs = trajectories(3)
    parts = split(collate(trajs, advs, 0), 5)
    assert [p.size for p in parts] == [1, 1, 1, 1, 1]
    assert [float(p.loss_mask.sum()) > 0 for p in parts].count(True) == 3


def _batch_of_lengths(lengths: list[int]) -> object:
    rng = random.Random(len(lengths))
    trajs = [Trajectory([2] * (n // 2), [rng.randrange(4, 30) for _ in range(n - n // 2)],
                        [-3.0] * (n - n // 2), [0] * (n - n // 2)) for n in lengths]
    return collate(trajs, [rng.gauss(0.0, 1.0) for _ in trajs], 0)


@st.composite
def any_trajectory(draw: st.DrawFn) -> Trajectory:
    prompt = draw(st.lists(st.integers(1, 50), min_size=1, max_size=12))
    n = draw(st.integers(1, 10))
    return Trajectory(prompt, draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)),
                      draw(st.lists(st.floats(-20, 0), min_size=n, max_size=n)),
                      draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
                      reward=draw(st.floats(0, 1)),
                      loss_mask=draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n)))


@settings(max_examples=80, deadline=None)
@given(st.lists(any_trajectory(), min_size=1, max_size=12), st.integers(0, 3))
def test_collate_puts_each_output_tokens_values_where_it_is_predicted_and_zero_elsewhere(trajs, version):
    """The layout of ``kuberl.policy.batch`` row by row: ids then padding, the attention mask over the
    real tokens, and per output token j (at position len(prompt) − 1 + j) its loss mask, behaviour
    log-prob and freshness (its version is the one training, and it is trained); zero everywhere else."""
    batch = collate(trajs, [0.5] * len(trajs), pad_id=0, version=version)
    width = max(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    assert batch.input_ids.shape == (len(trajs), width) and batch.loss_mask.shape == (len(trajs), width - 1)
    for i, t in enumerate(trajs):
        seq, start = t.prompt_ids + t.output_ids, len(t.prompt_ids) - 1
        assert batch.input_ids[i].tolist() == seq + [0] * (width - len(seq))
        assert batch.attention_mask[i].tolist() == [1] * len(seq) + [0] * (width - len(seq))
        outputs = range(start, start + len(t.output_ids))
        fresh = [float(v == version and m) for v, m in zip(t.versions, t.trained, strict=True)]
        for row, expected in ((batch.loss_mask, t.trained), (batch.behav_logp, t.behav_logprobs),
                              (batch.fresh_mask, fresh)):
            assert row[i, start:start + len(t.output_ids)].tolist() == pytest.approx(expected)
            assert all(float(row[i, p]) == 0.0 for p in range(width - 1) if p not in outputs)
    assert batch.rewards.tolist() == pytest.approx([t.reward for t in trajs])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 120), min_size=1, max_size=200), st.integers(8, 4096))
def test_micro_batches_fit_the_budget_keep_every_row_and_pay_the_least_padding_tried(lengths, budget):
    """Rows sorted by length, split into the chosen count and trimmed: every slice within the token
    budget (or one row), every row's tokens in exactly one slice, and the padded cost no more
    than the least count that fits pays (one slice whenever it fits)."""
    batch = _batch_of_lengths(lengths)
    count = micro_batch_count(batch, budget)
    chunks = [c.trimmed() for c in split(batch.by_length(), count)]
    assert all(c.input_ids.numel() <= budget or c.size == 1 for c in chunks)
    real = [c for c in chunks if c.loss_mask.sum() > 0]
    assert sorted(int(n) for c in real for n in c.lengths) == sorted(lengths)
    assert sum(float(c.loss_mask.sum()) for c in chunks) == float(batch.loss_mask.sum())

    def cost(n: int) -> int:
        chunks = [c.trimmed() for c in split(batch.by_length(), n)]
        return sum(c.input_ids.numel() for c in chunks) + n * PASS_COST_TOKENS

    fits = max(1, -(-len(lengths) // max(1, budget // max(lengths))))
    assert cost(count) <= cost(fits)


@pytest.mark.slow
def test_rows_of_very_different_lengths_train_in_length_sorted_micro_batches_as_in_one(world_of_one):
    """128 rows of mean length ~30 and one of 95 (the gateway's multi-turn episodes): several
    trimmed micro-batches instead of one padded to 95 — under half the padded tokens — and the
    same update as the whole batch in one pass."""
    rng = random.Random(0)
    batch = _batch_of_lengths([95] + [max(9, int(rng.gauss(30, 8))) for _ in range(127)])
    actors = [FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0) for _ in range(2)]
    chunks = actors[0]._micro_batches(batch)
    assert len(chunks) > 1 and sum(c.input_ids.numel() for c in chunks) < batch.input_ids.numel() / 2
    stats = [actors[0]._update(chunks, None, batch.size, float(batch.loss_mask.sum())),
             actors[1]._update([batch], None, batch.size, float(batch.loss_mask.sum()))]
    assert stats[0]["ppo_actor/loss"] == pytest.approx(stats[1]["ppo_actor/loss"], rel=1e-5)
    assert stats[0]["ppo_actor/grad_norm"] == pytest.approx(stats[1]["ppo_actor/grad_norm"], rel=1e-5)
    start, sorted_, whole = tiny_qwen2(40, seed=3).state_dict(), weights(actors[0]), weights(actors[1])
    apart = math.sqrt(sum(float((sorted_[n] - whole[n]).pow(2).sum()) for n in whole))
    update = math.sqrt(sum(float((whole[n] - start[n]).pow(2).sum()) for n in whole))
    assert apart < 1e-3 * update  # AdamW's step: the same up to summation order


def test_one_update_skips_the_proximal_pass_exactly(world_of_one):
    """mini_batches=1 uses π_prox = sg(π_θ); the explicit recomputation must give the same update."""
    trajs, advs = trajectories(12)
    batch = collate(trajs, advs, 0)
    results = []
    for explicit in (False, True):
        actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
        chunks = actor._micro_batches(batch)
        prox = None
        if explicit:
            with torch.no_grad():
                prox = [token_logprobs(actor.model, c, 1.0) for c in chunks]
        stats = actor._update(chunks, prox, batch.size, float(batch.loss_mask.sum()))
        results.append((weights(actor), stats["ppo_actor/loss"]))
    (shortcut, loss_a), (recomputed, loss_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name in shortcut:
        torch.testing.assert_close(shortcut[name], recomputed[name], rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(shortcut[n], tiny_qwen2(40, seed=3).state_dict()[n]) for n in shortcut)


def test_several_mini_batches_take_several_steps(world_of_one):
    trajs, advs = trajectories(8)
    one = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    two = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0, mini_batches=2)
    for actor in (one, two):
        actor.train_step(collate(trajs, advs, 0), len(trajs))
    assert two.optimizer.state[next(iter(two.model.parameters()))]["step"].item() == 2
    assert any(not torch.equal(a, b) for a, b in zip(weights(one).values(), weights(two).values(), strict=True))


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_behaviour_gap_measures_fresh_tokens_against_the_trainers_own_logprobs(world_of_one, mini_batches):
    """Tokens sampled by the weights being trained (version == the batch's version) must carry the
    trainer's own log-probs: the gap is ≈ 0 when they do, and exactly the injected offset when an
    engine reports other log-probs; older tokens (lag ≥ 1) do not count."""
    trajs, advs = trajectories(8)
    actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0, mini_batches=mini_batches)
    with torch.no_grad():
        own = token_logprobs(actor.model, collate(trajs, advs, 0), 1.0)
    for i, t in enumerate(trajs):  # what a faithful engine at version 5 would have reported
        start = len(t.prompt_ids) - 1
        t.behav_logprobs = own[i, start:start + len(t.output_ids)].tolist()
        t.versions = [5] * len(t.output_ids)
    trajs[0].behav_logprobs = [lp - 3.0 for lp in trajs[0].behav_logprobs]  # stale: lag 1, ignored
    trajs[0].versions = [4] * len(trajs[0].output_ids)
    faithful = actor.train_step(collate(trajs, advs, 0, version=5), len(trajs))
    fresh = sum(len(t.output_ids) for t in trajs[1:])
    assert faithful["mismatch/fresh_tokens"] == fresh
    assert faithful["mismatch/behav_logp_gap"] < 1e-5

    with torch.no_grad():  # the policy moved: what an engine at the new version 6 reports ...
        own = token_logprobs(actor.model, collate(trajs, advs, 0), 1.0)
    for i, t in enumerate(trajs[1:], start=1):
        start = len(t.prompt_ids) - 1
        t.behav_logprobs = own[i, start:start + len(t.output_ids)].tolist()
        t.versions = [6] * len(t.output_ids)
    trajs[1].behav_logprobs = [lp - 2.0 for lp in trajs[1].behav_logprobs]  # ... but broken on one row
    broken = actor.train_step(collate(trajs, advs, 0, version=6), len(trajs))
    offset_share = 2.0 * len(trajs[1].output_ids) / fresh
    assert broken["mismatch/behav_logp_gap"] == pytest.approx(offset_share, abs=1e-4)
    assert collate(trajs, advs, 0).fresh_mask.sum() == 0  # no version given: nothing is fresh


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_entropy_is_the_mean_over_trained_tokens_of_the_policy_the_engine_samples(world_of_one, mini_batches):
    """ppo_actor/entropy = mean over loss tokens of −Σ_v π(v) log π(v), π = softmax(logits / T):
    computed here from the model's raw logits, with prompt and padding positions left out. (Each
    update measures the weights it starts from; a tiny learning rate keeps them those measured here.)"""
    trajs, advs = trajectories(10, seed=1)
    temperature = 0.7
    actor = FSDPActor.create(tiny_qwen2(40, seed=5), CONFIG, lr=1e-9, temperature=temperature,
                             mini_batches=mini_batches)
    batch = collate(trajs, advs, 0)
    with torch.no_grad():
        logits = actor.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        per_token = -(probs * probs.log()).sum(-1)
    expected = float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum())
    stats = actor.train_step(batch, len(trajs))
    assert stats["ppo_actor/entropy"] == pytest.approx(expected, rel=1e-5)
    assert 0 < stats["ppo_actor/entropy"] < math.log(40)


def test_a_policy_that_cannot_tell_tokens_apart_has_the_entropy_of_the_uniform_distribution(world_of_one):
    trajs, advs = trajectories(4)
    model = tiny_qwen2(40, seed=3, tied=False)
    with torch.no_grad():  # every logit 0: π is uniform over the 40 tokens whatever the input
        model.lm_head.weight.zero_()
    stats = FSDPActor.create(model, CONFIG, lr=1e-9, temperature=1.0).train_step(collate(trajs, advs, 0), 4)
    assert stats["ppo_actor/entropy"] == pytest.approx(math.log(40), rel=1e-6)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _distance(actor: Actor, reference: dict[str, torch.Tensor]) -> float:
    return sum(float((w - reference[n]).norm()) for n, w in weights(actor).items())


def test_kl_term_keeps_the_policy_near_a_frozen_reference(world_of_one):
    """With kl_coef > 0, π_ref is the policy at freeze time and stays so while the policy trains; the
    loss reports KL > 0 once they differ, and a strong KL pull keeps the policy closer to π_ref."""
    from dataclasses import replace

    from kuberl.fsdp.actor import FSDPActor
    from kuberl.policy.actor import token_logprobs

    batches = [collate(*trajectories(8, seed=s), 0) for s in range(4)]
    start = weights(FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0))
    drift = {}
    for kl in (0.0, 1.0):
        actor = FSDPActor.create(tiny_qwen2(40, seed=3), replace(CONFIG, kl_coef=kl), lr=1e-2, temperature=1.0)
        assert (actor.reference is not None) == (kl > 0)
        actor.freeze_reference()
        kls = [actor.train_step(b, 8)["ppo_actor/kl"] for b in batches]
        drift[kl] = _distance(actor, start)
        if actor.reference is not None:
            assert kls[0] == 0.0 and all(k > 0 for k in kls[1:])  # identical at first, then apart
            frozen = full_weights(actor.reference)
            for name, tensor in start.items():
                assert torch.equal(frozen[name], tensor), name
            with torch.no_grad():
                assert not torch.equal(token_logprobs(actor.reference, batches[0], 1.0),
                                       token_logprobs(actor.model, batches[0], 1.0))
    assert drift[1.0] < drift[0.0]


def test_checkpoint_restores_the_reference_policy(world_of_one, tmp_path):
    """The reference comes back from the checkpoint (it is not the resumed policy); a checkpoint
    written without one cannot silently start a KL run from the wrong reference."""
    from dataclasses import replace

    from kuberl.checkpoint import CheckpointError
    from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer

    config = replace(CONFIG, kl_coef=0.5)
    actor = FSDPActor.create(tiny_qwen2(40, seed=3), config, lr=1e-2, temperature=1.0)
    actor.freeze_reference()
    for s in range(2):
        actor.train_step(collate(*trajectories(8, seed=s), 0), 8)
    save_trainer(actor, TrainerState.capture(2, 2, 16), tmp_path / "with-ref")
    resumed = FSDPActor.create(tiny_qwen2(40, seed=99), config, lr=1e-2, temperature=1.0)
    load_trainer(resumed, tmp_path / "with-ref")
    assert resumed.reference is not None and actor.reference is not None
    reference = full_weights(resumed.reference)
    for name, tensor in full_weights(actor.reference).items():
        assert torch.equal(reference[name], tensor), name
    assert any(not torch.equal(w, reference[n]) for n, w in weights(resumed).items())  # π_ref ≠ the policy

    plain = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    save_trainer(plain, TrainerState.capture(1, 1, 8), tmp_path / "without-ref")
    with pytest.raises(CheckpointError, match="klCoef"):
        load_trainer(FSDPActor.create(tiny_qwen2(40, seed=3), config, lr=1e-2, temperature=1.0),
                     tmp_path / "without-ref")


def _rank_main(rank: int, world: int, port: int, budget: int, out: str, files: str | None = None) -> None:
    """``files``: the model's saved directory, loaded as the trainer does (built on ``meta``, sharded,
    each rank reading its shards), trained with activation checkpointing; else built whole in place."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trajs, advs = trajectories(7)  # 7 rows over 2 ranks: 4 and 3, and different padded lengths
        if files is None:
            actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
        else:
            model, _, weights = load_skeleton(ModelSource(path=f"file://{files}"), 0)
            assert is_meta(model) and weights == Path(files)
            actor = FSDPActor.create(model, CONFIG, lr=1e-2, temperature=1.0, weights=weights,
                                 activation_checkpointing=True)
            loaded = actor.full_state_dict()
            if rank == 0:
                torch.save(loaded, f"{out}.loaded")
        actor.token_budget = budget
        local = list(range(rank, len(trajs), world))
        for _ in range(2):
            actor.train_step(collate([trajs[i] for i in local], [advs[i] for i in local], 0), len(trajs))
        state = actor.full_state_dict()
        if rank == 0:
            torch.save(state, out)
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


def _train(world: int, budget: int, out: str, files: str | None = None) -> dict[str, torch.Tensor]:
    start_workers(_rank_main, world, (world, FREE_PORT, budget, out, files))
    return torch.load(out)


@pytest.mark.slow
def test_data_parallel_matches_single_process(tmp_path):
    """2 FSDP2 ranks with a token budget that gives them different micro-batch counts train to the
    same weights as one process (gradients are the global token mean either way); so do 2 ranks that
    loaded the model from its files shard by shard (tied embeddings: one tensor in the file) and
    recompute their activations. Tolerance: two AdamW steps at lr 1e-2 move a weight whose gradient is
    near 0 by up to lr · sign(g); sums in another order (the ranks' halves, a recomputed block) differ in
    the last bits, which reached 1.7e-5 on some CPUs' kernels. A wrong gradient moves weights by ~1e-2."""
    single = _train(1, budget=30, out=str(tmp_path / "one.pt"))
    sharded = _train(2, budget=30, out=str(tmp_path / "two.pt"))
    tiny_qwen2(40, seed=3).save_pretrained(tmp_path / "model")
    from_files = _train(2, budget=30, out=str(tmp_path / "files.pt"), files=str(tmp_path / "model"))
    assert single.keys() == sharded.keys() == from_files.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(from_files[name], single[name], rtol=1e-3, atol=1e-4)
    original, loaded = tiny_qwen2(40, seed=3).state_dict(), torch.load(tmp_path / "files.pt.loaded")
    assert all(torch.equal(loaded[name], original[name]) for name in loaded)  # exactly the file's weights


def _load_from_files(rank: int, world: int, port: int, files: str, out: str) -> None:
    """Rank ``rank`` loads ``files`` as the trainer does (``meta``, sharded, its own shards read); rank 0
    saves the gathered weights and rank ``world − 1`` its own rows of the first stacked expert tensor."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, _, weights = load_skeleton(ModelSource(path=f"file://{files}"), 0)
        actor = FSDPActor.create(model, CONFIG, lr=1e-2, temperature=1.0, weights=weights)
        loaded = actor.full_state_dict()
        if rank == 0:
            torch.save(loaded, out)
        if rank == world - 1:
            stacked = actor.model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
            torch.save(stacked.to_local().clone(), f"{out}.last-rank")
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


@pytest.mark.slow
def test_a_mixture_of_experts_loads_from_its_files_shard_by_shard(tmp_path):
    """transformers stacks a Qwen3-MoE's per-expert tensors as it loads them and writes them back one
    per expert; 2 FSDP2 ranks building the model on ``meta`` read each expert's rows from the files
    (3 experts over 2 ranks: 2 and 1) and hold exactly the model's weights — the second rank the third
    expert's [gate; up]. Before, the trainer refused the directory (no ``experts.gate_up_proj`` in it)."""
    from kuberl.models.tiny import char_tokenizer, tiny_qwen3_moe

    original = tiny_qwen3_moe(len(char_tokenizer()), 5, experts=3, top_k=2)
    original.save_pretrained(tmp_path / "model")
    start_workers(_load_from_files, 2, (2, FREE_PORT, str(tmp_path / "model"), str(tmp_path / "loaded.pt")))
    loaded, expected = torch.load(tmp_path / "loaded.pt"), original.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    last_rows = torch.load(tmp_path / "loaded.pt.last-rank")
    assert torch.equal(last_rows, expected["model.layers.0.mlp.experts.gate_up_proj"][2:])


@pytest.mark.slow
def test_checkpoint_resume_is_exact(world_of_one, tmp_path, uri):
    """2K steps straight == K steps, checkpoint (through the manifest store, on a directory and on
    S3), fresh actor, resume, K more: identical weights, optimizer moments and counters."""
    from kuberl.checkpoint import CheckpointManager, open_store
    from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer

    batches = [collate(*trajectories(8, seed=s), 0) for s in range(6)]

    def run(actor: Actor, steps: range) -> None:
        for s in steps:
            actor.train_step(batches[s], 8)

    straight = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    run(straight, range(6))

    first = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    run(first, range(3))
    manager = CheckpointManager(open_store(uri), keep=2)
    manager.save(save_trainer(first, TrainerState.capture(3, 3, 24), tmp_path / "stage"), 3)
    rng_after_save = torch.rand(3)

    resumed = FSDPActor.create(tiny_qwen2(40, seed=99), CONFIG, lr=1e-2, temperature=1.0)  # other init: must not matter
    state = load_trainer(resumed, manager.restore(manager.latest(), tmp_path / "restored"))
    assert (state.step, state.version, state.data_position) == (3, 3, 24)
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored to the saved point
    run(resumed, range(3, 6))

    for name, tensor in weights(straight).items():
        assert torch.equal(weights(resumed)[name], tensor), name
    moments = [(straight.optimizer.state[p], resumed.optimizer.state[q])
               for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True)]
    for a, b in moments:
        assert torch.equal(a["step"], b["step"])
        assert torch.equal(a["exp_avg"].full_tensor(), b["exp_avg"].full_tensor())
        assert torch.equal(a["exp_avg_sq"].full_tensor(), b["exp_avg_sq"].full_tensor())


def _two_node_main(rank: int, port: int, uri: str, root: str, resume: bool, steps: int, out: str) -> None:
    """One rank per "node": each has its own, unshared staging directory and is its node's uploader."""
    from kuberl.trainer.checkpointing import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        batches = [trajectories(8, seed=s) for s in range(4)]
        actor = FSDPActor.create(tiny_qwen2(40, seed=3 if not resume else 42), CONFIG, lr=1e-2, temperature=1.0)
        checkpointer = Checkpointer(uri, every=2, keep=2, staging=Path(root) / f"node{rank}-{resume}", rank=rank,
                                    local_rank=0)  # fmt: skip
        first = 0
        if resume:
            state = checkpointer.resume(actor)
            assert state is not None and state.step == 2
            first = state.step
        for step in range(first, steps):
            trajs, advs = batches[step]
            local = list(range(rank, len(trajs), 2))
            actor.train_step(collate([trajs[i] for i in local], [advs[i] for i in local], 0), len(trajs))
            checkpointer.maybe_save(actor, step + 1, step + 1, 0)
        state_dict = actor.full_state_dict()
        if rank == 0:
            torch.save(state_dict, out)
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


@pytest.mark.slow
def test_checkpoints_from_nodes_without_shared_storage_resume_exactly(tmp_path, uri):
    """Two ranks on two "nodes" (separate staging dirs): each uploads its own shards, rank 0 writes
    the manifest; a fresh gang resumes from it and ends where an uninterrupted run ends."""
    from kuberl.checkpoint import CheckpointManager, open_store

    def run(resume: bool, steps: int, out: str) -> dict[str, torch.Tensor]:
        start_workers(_two_node_main, 2, (FREE_PORT, uri, str(tmp_path), resume, steps, out))
        return torch.load(out)

    straight = run(False, 4, str(tmp_path / "straight.pt"))
    manifest = CheckpointManager(open_store(uri)).latest()
    assert manifest is not None and manifest.step == 4
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= manifest.files.keys()  # both nodes' shards
    CheckpointManager(open_store(uri)).store.delete_prefix("step-00000004/")  # back to step 2, as if killed
    resumed = run(True, 4, str(tmp_path / "resumed.pt"))
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name
