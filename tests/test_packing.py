"""Sequence packing (``kuberl.policy.packing``): rows in first-fit bins give the padded path's
log-probs, entropy, loss, gradients and update, on dense and MoE models, from fewer tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import tiny_qwen2, tiny_qwen3_moe
from kuberl.policy.actor import Actor, packed_token_logprobs_and_entropy, token_logprobs_and_entropy
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, collate, micro_batch_count, split
from kuberl.policy.packing import first_fit_bins, pack, packed_tokens
from kuberl.rollout.types import Trajectory

CONFIG = AlgorithmConfig(name="grpo", group_size=4, behavior_imp_cap=None)
VOCAB = 40


def ragged_batch(lengths: list[int], seed: int = 0) -> Batch:
    """Rows of the given total lengths (a third prompt), random tokens, off-policy behaviour log-probs."""
    rng = random.Random(seed)
    trajs = []
    for n in lengths:
        prompt = max(1, n // 3)
        out = [rng.randrange(4, VOCAB) for _ in range(n - prompt)]
        trajs.append(Trajectory([2] + [rng.randrange(4, VOCAB) for _ in range(prompt - 1)], out,
                                [rng.uniform(-4.0, -3.0) for _ in out], [0] * len(out)))
    return collate(trajs, [rng.gauss(0.0, 1.0) for _ in trajs], 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=60), st.integers(1, 256))
def test_first_fit_places_every_row_once_within_the_width(lengths, width):
    bins = first_fit_bins(lengths, width)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))
    assert all(sum(lengths[r] for r in b) <= width or len(b) == 1 for b in bins)
    # first fit: no two bins could have been one (each bin's rows would not fit in any earlier bin's room)
    loads = [sum(lengths[r] for r in b) for b in bins]
    assert all(loads[i] + min(lengths[r] for r in bins[j]) > width
               for j in range(len(bins)) for i in range(j) if loads[i] <= width)


def test_packing_lays_rows_end_to_end_with_positions_restarting_per_sequence():
    batch = ragged_batch([9, 3, 5, 2])
    packing = pack(batch)
    assert packing.input_ids.shape == (3, 9)  # bins: [9], [5, 3] (+1 padding), [2] (+7)
    assert packing.position_ids[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0]
    assert packing.input_ids[1, :5].tolist() == batch.input_ids[2, :5].tolist()
    assert packed_tokens([9, 3, 5, 2]) == 3 * 9 and packing.input_ids.numel() < batch.input_ids.numel()


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_packed_logprobs_and_entropy_equal_the_padded_ones(model):
    batch = ragged_batch([40, 3, 7, 12, 25, 5, 9, 30, 2, 17])
    policy = (tiny_qwen2(VOCAB, seed=3) if model == "dense" else tiny_qwen3_moe(VOCAB, seed=3)).eval()
    with torch.no_grad():
        padded = token_logprobs_and_entropy(policy, batch, 0.7)
        packed = packed_token_logprobs_and_entropy(policy, batch, 0.7)
    real = batch.attention_mask[:, 1:].bool()
    assert pack(batch).input_ids.shape[0] < batch.size
    for want, got in zip(padded, packed, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
        assert not got[~real].any()


def _weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.full_state_dict().items()}


def test_a_packed_update_equals_the_padded_one(world_of_one):
    """The same loss, gradient norm and AdamW step through packed micro-batches as through padded
    ones — with token budgets that split the batch differently in each."""
    rng = random.Random(1)
    batch = ragged_batch([120] + [max(4, int(rng.lognormvariate(3.0, 0.6))) for _ in range(47)], seed=1)
    padded = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    packed = FSDPActor.create(tiny_qwen2(VOCAB, seed=3), CONFIG, lr=1e-2, temperature=1.0, packing=True)
    padded.token_budget, packed.token_budget = 1024, 4096
    tokens = float(batch.loss_mask.sum())
    chunks = [a._micro_batches(batch) for a in (padded, packed)]
    assert len(chunks[1]) < len(chunks[0])
    stats = [a._update(c, None, batch.size, tokens) for a, c in zip((padded, packed), chunks, strict=True)]
    assert stats[1]["ppo_actor/loss"] == pytest.approx(stats[0]["ppo_actor/loss"], rel=1e-5)
    assert stats[1]["ppo_actor/grad_norm"] == pytest.approx(stats[0]["ppo_actor/grad_norm"], rel=1e-5)
    start, one, other = tiny_qwen2(VOCAB, seed=3).state_dict(), _weights(padded), _weights(packed)
    apart = math.sqrt(sum(float((one[n] - other[n]).pow(2).sum()) for n in one))
    update = math.sqrt(sum(float((one[n] - start[n]).pow(2).sum()) for n in one))
    assert update > 0 and apart < 1e-3 * update


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 120), min_size=1, max_size=120), st.integers(64, 4096))
def test_packed_micro_batches_compute_no_more_than_padded_in_any_layer(lengths, budget):
    """The actor's micro-batches (the padded path's) packed: each within the budget (or one row), and
    in each, no more rows of the same width — so neither the attention, dense over a bin, nor any
    other layer computes more than padded."""
    batch = ragged_batch(lengths)
    chunks = [c.trimmed() for c in split(batch.by_length(), micro_batch_count(batch, budget))]
    for chunk in chunks:
        sizes = [int(n) for n in chunk.lengths]
        bins = pack(chunk).input_ids
        assert packed_tokens(sizes) <= budget or len(sizes) == 1
        assert bins.shape[1] == chunk.input_ids.shape[1] and bins.shape[0] <= chunk.size
