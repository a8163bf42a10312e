"""Property tests of the p2p weight-exchange planner over random layouts and topologies.

Every schedule is executed on numpy arrays (each trainer rank holds exactly its slice of a
ground-truth parameter), so "arrives exactly once, from a rank that holds it" is checked on the
bytes themselves, not on the planner's own bookkeeping.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.api.allocation import Dims, TrainerAllocation, parse_allocation
from kuberl.weights.layouts import (
    QWEN3_30B_A3B,
    ParamMeta,
    dest_shapes,
    fsdp2_holdings,
    inference_needs,
    inference_ranks,
    megatron_holdings,
)
from kuberl.weights.plan import (
    Bandwidths,
    Plan,
    PlanError,
    RankTopology,
    contains,
    plan,
    port_seconds,
    predicted_seconds,
    tier,
    volume,
)


def dense_params(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, itemsize: int):
    hd = 4
    out = [ParamMeta("model.embed_tokens.weight", (vocab, hidden), itemsize)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            ParamMeta(p + "input_layernorm.weight", (hidden,), itemsize),
            ParamMeta(p + "self_attn.q_proj.weight", (heads * hd, hidden), itemsize),
            ParamMeta(p + "self_attn.k_proj.weight", (kv * hd, hidden), itemsize),
            ParamMeta(p + "self_attn.v_proj.weight", (kv * hd, hidden), itemsize),
            ParamMeta(p + "self_attn.q_proj.bias", (heads * hd,), itemsize),
            ParamMeta(p + "self_attn.o_proj.weight", (hidden, heads * hd), itemsize),
            ParamMeta(p + "mlp.gate_proj.weight", (inter, hidden), itemsize),
            ParamMeta(p + "mlp.up_proj.weight", (inter, hidden), itemsize),
            ParamMeta(p + "mlp.down_proj.weight", (hidden, inter), itemsize),
        ]
    return [
        *out,
        ParamMeta("model.norm.weight", (hidden,), itemsize),
        ParamMeta("lm_head.weight", (vocab, hidden), itemsize),
    ]


@st.composite
def layouts(draw):
    layers = draw(st.integers(1, 2))
    params = dense_params(
        layers,
        hidden=draw(st.sampled_from([16, 24, 32, 48])),
        heads=draw(st.sampled_from([4, 8])),
        kv=draw(st.sampled_from([2, 4])),
        inter=draw(st.sampled_from([32, 40, 64])),
        vocab=draw(st.integers(30, 120)),
        itemsize=draw(st.sampled_from([2, 4])),
    )
    n_train = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    trainers = list(range(n_train))
    if draw(st.booleans()):
        replicate = draw(st.sampled_from([r for r in (1, 2, 3) if n_train % r == 0]))
        holdings = fsdp2_holdings(params, trainers, replicate)
    else:
        tp = draw(st.sampled_from([t for t in (1, 2, 4) if n_train % t == 0]))
        pp = draw(st.sampled_from([p for p in (1, 2) if (n_train // tp) % p == 0 and p <= layers]))
        dims = Dims(tensor=tp, pipeline=pp, data=n_train // tp // pp)
        holdings = megatron_holdings(params, trainers, TrainerAllocation("megatron", dims), layers)
    n_rep, inf_tp = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4]))
    replicas = [[n_train + r * inf_tp + t for t in range(inf_tp)] for r in range(n_rep)]
    needs = inference_needs(params, replicas, fuse=draw(st.booleans()))
    zones, fabrics, nodes = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    all_ranks = n_train + n_rep * inf_tp
    place = draw(st.lists(st.integers(0, zones * fabrics * nodes - 1), min_size=all_ranks, max_size=all_ranks))
    ranks = {
        r: RankTopology(node=f"n{p}", fabric=f"f{p // nodes}", zone=f"z{p // nodes // fabrics}")
        for r, p in enumerate(place)
    }
    bw = draw(st.sampled_from([Bandwidths.uniform(), Bandwidths(node=200.0, fabric=100.0, zone=50.0, cross=10.0)]))
    return params, holdings, needs, ranks, bw


def execute(params: list[ParamMeta], holdings, needs, p: Plan) -> None:
    """Run the schedule on numpy arrays and check each need got exactly its bytes, once."""
    truth = {m.name: np.arange(int(np.prod(m.shape)), dtype=np.int64).reshape(m.shape) + 1 for m in params}
    local = {(h.rank, h.param, h.box): truth[h.param][tuple(slice(a, b) for a, b in h.box)] for h in holdings}
    dest_ranks = {n.rank for n in needs}
    received = {r: {k: np.zeros(s, np.int64) for k, s in dest_shapes(needs, r).items()} for r in dest_ranks}
    count = {r: {k: np.zeros(s, np.int64) for k, s in dest_shapes(needs, r).items()} for r in dest_ranks}
    for t in p.transfers:
        held = [(box, arr) for (rank, name, box), arr in local.items() if rank == t.src and name == t.param]
        assert any(contains(box, t.box) for box, _ in held), f"rank {t.src} sends {t.param}{t.box} it does not hold"
        src = next(arr for box, arr in held if contains(box, t.box))
        assert all(0 <= a < b <= n for (a, b), n in zip(t.src_box, src.shape, strict=True))
        data = src[tuple(slice(a, b) for a, b in t.src_box)]
        np.testing.assert_array_equal(data, truth[t.param][tuple(slice(a, b) for a, b in t.box)])
        region = tuple(slice(a, b) for a, b in t.dest_box)
        received[t.dst][t.dest][region] = data
        count[t.dst][t.dest][region] += 1
        assert t.nbytes == volume(t.box) * next(m.itemsize for m in params if m.name == t.param)
    for n in needs:
        region = tuple(slice(a, b) for a, b in n.dest_box)
        np.testing.assert_array_equal(
            received[n.rank][n.dest][region], truth[n.param][tuple(slice(a, b) for a, b in n.box)]
        )
        assert (count[n.rank][n.dest][region] == 1).all(), (
            f"rank {n.rank} {n.dest}{n.dest_box} not delivered exactly once"
        )
    for r in dest_ranks:  # nothing arrives that was not needed
        for name, c in count[r].items():
            assert c.sum() == sum(volume(n.dest_box) for n in needs if n.rank == r and n.dest == name)


@settings(max_examples=150, deadline=None)
@given(layouts())
@pytest.mark.slow
def test_schedule_delivers_every_needed_byte_once_from_a_nearest_holder_and_balances_links(case):
    params, holdings, needs, ranks, bw = case
    p = plan(holdings, needs, ranks, {m.name: m.itemsize for m in params}, bw)
    execute(params, holdings, needs, p)
    for t in p.transfers:  # topology preference: no holder of these bytes is nearer than the sender
        holders = [h.rank for h in holdings if h.param == t.param and contains(h.box, t.box)]
        assert tier(ranks[t.src], ranks[t.dst]) == min(tier(ranks[h], ranks[t.dst]) for h in holders)
    predicted = predicted_seconds(p, bw)
    assert p.lower_bound_seconds <= predicted * (1 + 1e-9)
    assert predicted <= 1.05 * p.lower_bound_seconds, (predicted, p.lower_bound_seconds)


def test_hsdp_replicas_split_the_sending_and_same_node_holders_are_preferred():
    params = [ParamMeta("w", (64, 8), 4)]
    holdings = fsdp2_holdings(params, [0, 1, 2, 3], replicate=2)  # ranks 0,2 hold rows 0-31; 1,3 rows 32-63
    ranks = {0: RankTopology("a"), 1: RankTopology("a"), 2: RankTopology("b"), 3: RankTopology("b"),
             4: RankTopology("c"), 5: RankTopology("b")}  # fmt: skip
    needs = inference_needs(params, [[4], [5]])
    p = plan(holdings, needs, ranks, {"w": 4})
    far = [t for t in p.transfers if t.dst == 4]
    assert sorted({t.src for t in far}) == [0, 1, 2, 3]  # each replica copy sends a quarter
    assert all(t.nbytes == 16 * 8 * 4 for t in far)
    assert {t.src for t in p.transfers if t.dst == 5} == {2, 3}  # same node as rank 5
    assert predicted_seconds(p, Bandwidths.uniform()) == p.lower_bound_seconds == 64 * 8 * 4


def test_fused_qkv_shards_land_at_vllm_offsets():
    params = dense_params(1, hidden=8, heads=4, kv=2, inter=16, vocab=10, itemsize=2)
    needs = inference_needs(params, [[1, 2]], fuse=True)
    qkv = sorted((n.dest_box[0], n.param.split(".")[-2], n.box[0]) for n in needs
                 if n.rank == 2 and n.dest.endswith("qkv_proj.weight"))  # fmt: skip
    assert qkv == [((0, 8), "q_proj", (8, 16)), ((8, 12), "k_proj", (4, 8)), ((12, 16), "v_proj", (4, 8))]
    assert dest_shapes(needs, 2)["model.layers.0.self_attn.qkv_proj.weight"] == (16, 8)


def test_a_need_nobody_holds_is_an_error_naming_the_parameter():
    params = [ParamMeta("w", (8, 2), 4)]
    holdings = [h for h in fsdp2_holdings(params, [0, 1]) if h.rank == 0]  # rows 4-7 lost
    with pytest.raises(PlanError, match=r"'w' region .* needed by rank 2 is not fully held"):
        plan(holdings, inference_needs(params, [[2]]), {r: RankTopology(f"n{r}") for r in range(3)}, {"w": 4})
    with pytest.raises(PlanError, match="no trainer rank holds parameter 'w'"):
        plan([], inference_needs(params, [[2]]), {r: RankTopology(f"n{r}") for r in range(3)}, {"w": 4})


@pytest.mark.slow
def test_megatron_moe_layout_of_qwen3_30b_reaches_the_receiver_bound():
    """The shipped Ascend example's layout at full scale, restricted to 4 layers to stay fast."""
    shape = QWEN3_30B_A3B
    params = [m for m in shape.params() if not any(f"layers.{i}." in m.name for i in range(4, shape.layers))]
    allocation = parse_allocation("vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)")  # examples/ascend-qwen3-30b-a3b
    holdings = megatron_holdings(params, list(range(32)), allocation.trainer, 4, shape.experts)
    needs = inference_needs(params, inference_ranks(allocation.inference, first=32), fuse=True)
    ranks = {r: RankTopology(f"n{r // 8}", "f0", "z0") for r in range(48)}
    bw = Bandwidths(node=196e9, fabric=50e9, zone=50e9, cross=25e9)
    p = plan(holdings, needs, ranks, {m.name: m.itemsize for m in params}, bw)
    busy = port_seconds(p, bw)
    assert predicted_seconds(p, bw) <= 1.05 * p.lower_bound_seconds
    assert max(v for (r, _, d), v in busy.items() if d == "in") == pytest.approx(p.lower_bound_seconds, rel=0.05)
