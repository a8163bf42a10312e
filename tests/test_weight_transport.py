"""The p2p transport moves real tensors: FSDP2 trainer ranks → inference ranks, bit for bit.

Processes: ``TRAINERS`` ranks that shard the tiny Qwen2 with FSDP2 (their own gloo world) and
``REPLICAS`` receivers that hold an unsharded model; all of them also join one exchange group.
Every receiver must end up with the trainer's full state exactly.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from kuberl.collectives import exit_without_teardown
from kuberl.models.tiny import char_tokenizer, tiny_qwen2, tiny_qwen3_moe
from kuberl.weights.layouts import fsdp2_holdings, inference_needs
from kuberl.weights.plan import RankTopology, plan
from kuberl.weights.relay import StagedPlan, relayed_plan
from kuberl.weights.transport import local_tensor, open_group, param_metas, run_exchange, run_staged

from .workers import FREE_PORT, start_workers

TRAINERS, REPLICAS = 3, 2


def _model(seed: int) -> torch.nn.Module:
    return tiny_qwen2(len(char_tokenizer()), seed)


def _worker(rank: int, train_port: int, exchange_port: int, out: str, relayed: bool) -> None:
    torch.manual_seed(0)
    full = dict(_model(seed=7).named_parameters())
    metas = param_metas(full)
    trainers = list(range(TRAINERS))
    replicas = [[TRAINERS + r] for r in range(REPLICAS)]
    topology = {r: RankTopology(node=f"node{r % 2}") for r in range(TRAINERS + REPLICAS)}
    make = relayed_plan if relayed else plan
    schedule = make(fsdp2_holdings(metas, trainers), inference_needs(metas, replicas), topology,
                    {m.name: m.itemsize for m in metas})  # fmt: skip
    sources: dict[str, torch.Tensor] = {}
    dests: dict[str, torch.Tensor] = {}
    if rank < TRAINERS:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port}", rank=rank, world_size=TRAINERS)
        model = _model(seed=7)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sources = {name: local_tensor(p) for name, p in model.named_parameters()}
    else:
        dests = {m.name: torch.zeros(m.shape) for m in metas}
    pg = open_group("127.0.0.1", exchange_port, rank, TRAINERS + REPLICAS, bind_host="127.0.0.1", timeout_s=60)
    if isinstance(schedule, StagedPlan):  # stage 2 from what each replica received in stage 1
        stats = run_staged(pg, schedule.for_rank(rank), rank, sources, dests, schedule.relay_sources.get(rank, []))
    else:
        stats = run_exchange(pg, schedule.for_rank(rank), rank, sources, dests, bucket_bytes=4096)
    if rank >= TRAINERS:
        identical = all(torch.equal(dests[name], full[name].detach()) for name in full)
        Path(out, f"{rank}.txt").write_text(f"{identical} {stats.bytes_received} {stats.messages} {stats.bytes_sent}")
    else:
        Path(out, f"{rank}.txt").write_text(f"sent {stats.bytes_sent}")
        dist.destroy_process_group()
    exit_without_teardown(0)


@pytest.mark.slow
def test_fsdp2_shards_reach_every_replica_bit_identical(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start_workers(_worker, TRAINERS + REPLICAS, (FREE_PORT, FREE_PORT, str(tmp_path), False))
    total = sum(p.numel() * p.element_size() for p in _model(seed=7).parameters())
    for r in range(TRAINERS, TRAINERS + REPLICAS):
        identical, nbytes, messages, _ = (tmp_path / f"{r}.txt").read_text().split()
        assert identical == "True"
        assert int(nbytes) == total
        assert int(messages) > TRAINERS  # 4 KiB buckets: several messages per sender
    sent = [int((tmp_path / f"{r}.txt").read_text().split()[1]) for r in range(TRAINERS)]
    assert sum(sent) == REPLICAS * total
    assert max(sent) < 0.5 * REPLICAS * total  # the trainer ranks share the sending


@pytest.mark.slow
def test_a_schedule_relayed_through_the_replicas_reaches_every_replica_bit_identical(tmp_path):
    """Stage 1 sends each piece from the shards to one replica; stage 2 that replica forwards it from
    its own received tensors: the trainer sends the model once, and every replica still gets all of it."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start_workers(_worker, TRAINERS + REPLICAS, (FREE_PORT, FREE_PORT, str(tmp_path), True))
    total = sum(p.numel() * p.element_size() for p in _model(seed=7).parameters())
    forwarded = 0
    for r in range(TRAINERS, TRAINERS + REPLICAS):
        identical, nbytes, _, sent = (tmp_path / f"{r}.txt").read_text().split()
        assert identical == "True" and int(nbytes) == total
        forwarded += int(sent)
    sent = [int((tmp_path / f"{r}.txt").read_text().split()[1]) for r in range(TRAINERS)]
    assert sum(sent) == total and forwarded == (REPLICAS - 1) * total


MEGATRON_LAYOUTS = {  # the output layer splits over the vocabulary too
    "tensor2": (lambda: tiny_qwen2(len(char_tokenizer()), 7, tied=False), {"tensor_model_parallel_size": 2}),
    "expert2": (lambda: tiny_qwen3_moe(len(char_tokenizer()), 7), {"expert_model_parallel_size": 2}),
    "pipeline2": (lambda: tiny_qwen2(len(char_tokenizer()), 7, tied=True), {"pipeline_model_parallel_size": 2}),
    "context2": (lambda: tiny_qwen2(len(char_tokenizer()), 7, tied=False), {"context_parallel_size": 2}),
}


def _megatron_worker(rank: int, train_port: int, exchange_port: int, layout: str, out: str) -> None:
    """Ranks 0 and 1: a Megatron trainer laid out as ``MEGATRON_LAYOUTS[layout]`` whose pieces are then
    changed at random (so what arrives cannot be the HF weights it loaded); rank 2: a replica. The
    plan comes from the trainer (as rank 0 hands it to replicas in a run)."""
    from megatron.core import parallel_state

    from kuberl.megatron.actor import MegatronActor
    from kuberl.policy.algorithms import AlgorithmConfig
    from kuberl.weights.p2p import plan_for

    make, parallel = MEGATRON_LAYOUTS[layout]
    hf = make()
    metas = param_metas(dict(hf.named_parameters()))
    sources: dict[str, torch.Tensor] = {}
    dests: dict[str, torch.Tensor] = {}
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port}", rank=rank, world_size=2)
        parallel_state.initialize_model_parallel(**parallel)
        actor = MegatronActor.from_hf(hf, AlgorithmConfig(name="grpo", group_size=2), lr=1e-3, temperature=1.0)
        torch.manual_seed(0)  # the same noise on every rank: what two ranks both hold whole stays equal
        with torch.no_grad():
            for name, param in actor.model.named_parameters():
                noise = torch.randn((2, *param.shape))  # an expert's noise: its rank's (the rest: alike)
                param.add_(noise[parallel_state.get_expert_model_parallel_rank() if "experts" in name else 0])
        metas = param_metas(actor.named_parameters())
        topology = [RankTopology(node="node0")] * 3
        schedule = plan_for(metas, actor.holdings(metas), topology[:2], topology[2:])
        sources, mine = actor.local_parameters(), schedule.for_rank(rank)
        whole = actor.full_state_dict()  # the gathered export: what broadcast and disk send
        if rank == 0:
            torch.save({"transfers": schedule.for_rank(2), "whole": whole}, Path(out, "plan.pt.partial"))
            os.replace(Path(out, "plan.pt.partial"), Path(out, "plan.pt"))
    else:
        while not Path(out, "plan.pt").exists():
            time.sleep(0.05)
        expected = torch.load(Path(out, "plan.pt"), weights_only=False)
        mine = expected["transfers"]
        dests = {m.name: torch.zeros(m.shape) for m in metas}
    pg = open_group("127.0.0.1", exchange_port, rank, 3, bind_host="127.0.0.1", timeout_s=60)
    stats = run_exchange(pg, mine, rank, sources, dests, bucket_bytes=4096)
    if rank == 2:
        whole = expected["whole"]
        # every parameter (a tied output layer is the embedding: the export names it twice, p2p once)
        same = set(dests) <= set(whole) and all(torch.equal(dests[n], whole[n]) for n in dests)
        Path(out, "replica.txt").write_text(f"{same} {stats.bytes_received}")
    else:
        Path(out, f"{rank}.txt").write_text(f"{stats.bytes_sent}")
        dist.destroy_process_group()
    exit_without_teardown(0)


@pytest.mark.parametrize("layout", sorted(MEGATRON_LAYOUTS))
@pytest.mark.slow
def test_megatron_tensor_expert_and_pipeline_parallel_pieces_reach_a_replica_as_the_gathered_hf_weights(
        tmp_path, layout):
    """p2p from Megatron: each tensor-parallel rank sends its own pieces under HF names (q/k/v out of
    its fused query groups, gate/up out of its fused MLP input, its vocabulary rows, its o/down
    columns); each expert-parallel rank its experts' rows of the stacked HF expert tensors (the rest,
    held alike by both, shared out by the planner); each pipeline stage its layers (the first the tied
    embedding, the last the final norm) under whole-model layer numbers; the two ranks of a
    context-parallel pair, which hold the same weights, share the sending; the replica ends with exactly the weights the
    trainer's gathered export has, and each rank sent its share."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start_workers(_megatron_worker, 3, (FREE_PORT, FREE_PORT, layout, str(tmp_path)))
    same, received = (tmp_path / "replica.txt").read_text().split()
    assert same == "True"
    total = sum(p.numel() * p.element_size() for p in MEGATRON_LAYOUTS[layout][0]().parameters())
    assert int(received) == total
    sent = [int((tmp_path / f"{r}.txt").read_text()) for r in range(2)]
    assert sum(sent) == total and min(sent) > 0.3 * total  # both ranks send their pieces
