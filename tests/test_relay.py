"""The relayed (two-stage) p2p schedule: chosen where the trainer has fewer ports than the pool has
receivers, and when carried out — stage 1 from the trainer shards, stage 2 from what each seed
received, in its own destination tensors — every inference rank holds exactly the parameters."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.weights.layouts import ParamMeta, chunk_range, dest_shapes, fsdp2_holdings, inference_needs
from kuberl.weights.plan import Bandwidths, RankTopology, full_box, plan, predicted_seconds, volume
from kuberl.weights.relay import StagedPlan, relayed_plan, staged_plan
from kuberl.weights.transport import _region

PARAMS = [ParamMeta(name, shape, 4) for name, shape in [
    ("embed.weight", (64, 16)), ("layers.0.self_attn.q_proj.weight", (16, 16)),
    ("layers.0.self_attn.k_proj.weight", (8, 16)), ("layers.0.self_attn.v_proj.weight", (8, 16)),
    ("layers.0.mlp.gate_proj.weight", (40, 16)), ("layers.0.mlp.up_proj.weight", (40, 16)), ("norm.weight", (16,))]]


def cluster(trainers: int, replicas: list[list[int]]) -> dict[int, RankTopology]:
    """Every trainer rank on a node of its own, and every replica (its tensor-parallel ranks together)."""
    nodes = {t: f"trainer{t}" for t in range(trainers)}
    nodes |= {rank: f"replica{i}" for i, replica in enumerate(replicas) for rank in replica}
    return {rank: RankTopology(node=node, zone="z") for rank, node in nodes.items()}


def full_parameters(params: list[ParamMeta]) -> dict[str, torch.Tensor]:
    """Each parameter whole, its elements numbered 1, 2, 3, … (every element tells where it came from)."""
    return {p.name: torch.arange(1, 1 + volume(full_box(p.shape)), dtype=torch.float32).view(p.shape)
            for p in params}


def carry_out(staged: StagedPlan, params: list[ParamMeta], trainers: int, needs) -> dict[int, dict[str, torch.Tensor]]:
    """Run the stages in order on real tensors (what run_exchange does, without the network): trainer
    rank t holds its FSDP2 rows of each parameter (values 1, 2, 3, …); returns each receiver's tensors."""
    full = full_parameters(params)
    shards = {t: {p.name: full[p.name][slice(*chunk_range(p.shape[0], trainers, t))] for p in params}
              for t in range(trainers)}
    receivers = sorted({n.rank for n in needs})
    dests = {r: {name: torch.zeros(shape) for name, shape in dest_shapes(needs, r).items()} for r in receivers}
    for index, stage in enumerate(staged.stages):
        for t in stage.transfers:
            if index == 0:
                source = shards[t.src][t.param]
            else:  # a seed's sending tensor: the region of its destination tensor the piece landed in
                [(dest, box)] = [(d, b) for p, d, b in staged.relay_sources[t.src] if p == t.param]
                source = _region(dests[t.src][dest], box)
            _region(dests[t.dst][t.dest], t.dest_box).copy_(_region(source, t.src_box))
    return {r: dests[r] for r in receivers}


def assert_every_rank_holds_its_needs(received, needs, params) -> None:
    full = full_parameters(params)
    for n in needs:
        assert torch.equal(_region(received[n.rank][n.dest], n.dest_box), _region(full[n.param], n.box)), n


def test_a_pool_larger_than_the_trainer_is_relayed_and_every_replica_gets_the_model_exactly():
    replicas = [[2 + i] for i in range(4)]
    needs = inference_needs(PARAMS, replicas)
    holdings = fsdp2_holdings(PARAMS, [0, 1])
    itemsize = {p.name: p.itemsize for p in PARAMS}
    staged = staged_plan(holdings, needs, cluster(2, replicas), itemsize)
    direct = plan(holdings, needs, cluster(2, replicas), itemsize)
    assert staged.relayed and staged.predicted_seconds(Bandwidths.uniform()) < predicted_seconds(direct,
                                                                                                  Bandwidths.uniform())
    model = sum(p.nbytes for p in PARAMS)
    assert staged.bytes_received() == {r: model for [r] in replicas}  # each byte arrives once per replica
    assert sum(staged.stages[0].bytes_sent().values()) == model  # the trainer sends the model once, not 4 times
    assert_every_rank_holds_its_needs(carry_out(staged, PARAMS, 2, needs), needs, PARAMS)


def test_a_region_larger_than_a_ranks_share_is_seeded_in_pieces_by_several_ranks():
    """8 replicas: the embedding (36 % of the model) seeded whole would make its one seed upload it 7 times
    in stage 2; cut into pieces, the pool's ranks each seed about an eighth, and the model still arrives whole."""
    replicas = [[1 + i] for i in range(8)]
    needs = inference_needs(PARAMS, replicas)
    itemsize = {p.name: p.itemsize for p in PARAMS}
    staged = relayed_plan(fsdp2_holdings(PARAMS, [0]), needs, cluster(1, replicas), itemsize)
    seeds_of_embed = {t.dst for t in staged.stages[0].transfers if t.param == "embed.weight"}
    assert len(seeds_of_embed) >= 3
    seeded = staged.stages[0].bytes_received()
    model = sum(p.nbytes for p in PARAMS)
    assert sum(seeded.values()) == model and max(seeded.values()) <= 2 * model / len(replicas)
    assert_every_rank_holds_its_needs(carry_out(staged, PARAMS, 1, needs), needs, PARAMS)


def test_a_trainer_with_as_many_ports_as_the_pool_sends_directly():
    replicas = [[4 + i] for i in range(4)]
    needs = inference_needs(PARAMS, replicas)
    staged = staged_plan(fsdp2_holdings(PARAMS, [0, 1, 2, 3]), needs, cluster(4, replicas),
                         {p.name: p.itemsize for p in PARAMS})
    assert not staged.relayed


def test_fused_and_tensor_parallel_replicas_are_relayed_exactly():
    """vLLM-shaped receivers: q/k/v fused into one tensor, two replicas of tensor parallel 2."""
    replicas = [[1, 2], [3, 4]]
    needs = inference_needs(PARAMS, replicas, fuse=True)
    staged = relayed_plan(fsdp2_holdings(PARAMS, [0]), needs, cluster(1, replicas),
                          {p.name: p.itemsize for p in PARAMS})
    assert_every_rank_holds_its_needs(carry_out(staged, PARAMS, 1, needs), needs, PARAMS)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 2), st.booleans())
def test_a_relayed_schedule_carried_out_gives_every_rank_exactly_its_needs(trainers, replicas, tp, fuse):
    groups = [[trainers + i * tp + t for t in range(tp)] for i in range(replicas)]
    needs = inference_needs(PARAMS, groups, fuse=fuse)
    staged = relayed_plan(fsdp2_holdings(PARAMS, list(range(trainers))), needs, cluster(trainers, groups),
                          {p.name: p.itemsize for p in PARAMS})
    assert_every_rank_holds_its_needs(carry_out(staged, PARAMS, trainers, needs), needs, PARAMS)
    # a seed forwards only what it received in stage 1
    firsts = {(t.dst, t.param) for t in staged.stages[0].transfers}
    assert all((t.src, t.param) in firsts for t in staged.stages[1].transfers)


def test_relaying_must_save_a_tenth_of_the_direct_time():
    from kuberl.weights.relay import relay_pays

    assert relay_pays(0.9, 1.0) and not relay_pays(0.95, 1.0) and not relay_pays(1.0, 1.0)
