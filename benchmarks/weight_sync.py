"""Weight sync: naive ``broadcast``, ``pipelined`` broadcast and topology-aware ``p2p``, on an
emulated cluster, bit-checked.

N trainer nodes run FSDP2 ranks of a Qwen2-style model of a few hundred MB; M inference nodes hold
an unsharded copy. Each node is a network namespace whose link is shaped with ``tc`` (default
500 Mbit/s each way), so the bytes really queue on per-node NICs (see ``netem.py``); without root
or iproute2 it falls back to plain loopback and says so. Each sync first changes every trainer
shard (w ← w₀ + sync number) and zeroes every receiver, so each sync is checked on fresh bytes.

- ``broadcast``: what the product's broadcast mode does — gather the full state on trainer rank 0
  (``get_model_state_dict``, an all-gather), then rank 0 sends all of it to every replica.
- ``pipelined``: the strongest broadcast, as NCCL's is — gather on rank 0 as above, then the model
  flows down a chain (rank 0 → replica 1 → replica 2 → …) in chunks of ``CHUNK_BYTES``, each replica
  forwarding a chunk while it receives the next: every link carries the model once.
- ``p2p``: the planner's schedule; every trainer rank sends its own shard to every replica.
- ``p2p-relay``: the two-stage schedule (:mod:`kuberl.weights.relay`): each distinct piece goes from
  the trainer shards to one replica (its seed), which forwards it to the others once it has its own
  stage-1 pieces. ``chosen_by_the_planner`` (``relay_chosen`` in ``--simulate``) says whether the
  planner would pick it over ``p2p`` (predicted at least 10 % faster).

The join case (``--joiners J``, default 1, on J more nodes): J new replicas get the current version
while the M replicas already hold it — ``join-trainers`` from the trainer shards (what the product
does: the group re-formed with the joiners at the next push), ``join-peers`` from the replicas that
hold it (the planner given them as holders); each with the planner's prediction (its cost model at
the link rate) beside the measured seconds.

    python benchmarks/weight_sync.py [--trainer-nodes 4 --replica-nodes 4 --link-mbit 500]
    python benchmarks/weight_sync.py --simulate     # planner + cost model at cluster scale

Progress goes to stderr; the last stdout line is the JSON result (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent / "workload"), str(ROOT)]

from netem import NetemUnavailable, emulated_cluster  # noqa: E402

from kuberl.api.allocation import parse_allocation  # noqa: E402
from kuberl.weights.layouts import (  # noqa: E402
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    MoEShape,
    ParamMeta,
    fsdp2_holdings,
    inference_needs,
    inference_ranks,
    megatron_holdings,
)
from kuberl.weights.plan import Bandwidths, Holding, RankTopology, full_box, plan, predicted_seconds  # noqa: E402
from kuberl.weights.relay import StagedPlan, relay_pays, relayed_plan  # noqa: E402

TRAIN_PORT, EXCHANGE_PORT = 29510, 29511
CHUNK_BYTES = 4 << 20  # the pipelined broadcast's unit (NCCL's default chunks are smaller; 4 MiB suits gloo)
MODES = ("broadcast", "pipelined", "p2p", "p2p-relay")
JOIN_MODES = ("join-trainers", "join-peers")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- cluster-scale simulation (planner + cost model only) ----------------------------------


def simulate_case(shape: MoEShape, allocation: str, per_node: int, nic_gbit: float) -> dict:
    """Plan ``allocation`` (AReaL syntax, as in a manifest) for ``shape``, one NIC per accelerator,
    trainer ranks first, then the inference ranks, ``per_node`` ranks per node."""
    params = shape.params()
    alloc = parse_allocation(allocation)
    trainers = list(range(alloc.trainer.devices))
    holdings = megatron_holdings(params, trainers, alloc.trainer, shape.layers, shape.experts)
    replicas = inference_ranks(alloc.inference, first=len(trainers))
    needs = inference_needs(params, replicas, fuse=True)
    everyone = trainers + [r for replica in replicas for r in replica]
    ranks, bw = simulated_cluster(everyone, per_node, nic_gbit)
    itemsize = {p.name: p.itemsize for p in params}
    started = time.perf_counter()
    p2p = plan(holdings, needs, ranks, itemsize, bw)
    planning = time.perf_counter() - started
    naive = plan(_full_on(0, params), needs, ranks, itemsize, bw)
    relay = relayed_plan(holdings, needs, ranks, itemsize, bw).predicted_seconds(bw)
    predicted = predicted_seconds(p2p, bw)
    model_bytes = sum(p.nbytes for p in params)
    # every rank here is in one zone: the chain's node-to-node hops run at one NIC's rate; a replica of t
    # tensor-parallel ranks is fed by t chains side by side, each carrying the 1/t its rank loads
    tensor = alloc.inference.dims.tensor
    pipelined = pipelined_broadcast_seconds(model_bytes // tensor, len(replicas), bw.zone)
    return {
        "model_bytes": model_bytes,
        "allocation": allocation,
        "nodes": f"{len(trainers) // per_node} trainer + {(len(everyone) - len(trainers)) // per_node} inference "
        f"nodes x {per_node} accelerators",
        "nic_gbit": nic_gbit,
        "transfers": len(p2p.transfers),
        "planning_seconds": round(planning, 1),
        "predicted_seconds": round(predicted, 4),
        "lower_bound_seconds": round(p2p.lower_bound_seconds, 4),
        "predicted_over_lower_bound": round(predicted / p2p.lower_bound_seconds, 4),
        "broadcast_predicted_seconds": round(predicted_seconds(naive, bw), 3),
        "pipelined_broadcast_predicted_seconds": round(pipelined, 4),
        "speedup_vs_pipelined": round(pipelined / predicted, 2),
        "relay_predicted_seconds": round(relay, 4),
        "relay_chosen": relay_pays(relay, predicted),
        "single_replica_physical_bound_seconds": round(model_bytes / (per_node * bw.zone), 4),
    }


def simulated_cluster(everyone: list[int], per_node: int, nic_gbit: float) -> tuple[dict[int, RankTopology],
                                                                                     Bandwidths]:
    """Ranks ``per_node`` to a node in one zone, one NIC of ``nic_gbit`` per accelerator, NVLink-class links
    inside a node (4 × the NIC) and half a NIC across zones: each rank's place and the tiers' rates."""
    ranks = {r: RankTopology(node=f"node{r // per_node}", fabric="", zone="zone-a") for r in everyone}
    nic = nic_gbit * 1e9 / 8
    return ranks, Bandwidths(node=4 * nic, fabric=nic, zone=nic, cross=nic / 2)


def pipelined_broadcast_seconds(model_bytes: int, receivers: int, link_bytes_per_s: float,
                                chunk_bytes: int = CHUNK_BYTES) -> float:
    """A chain broadcast's time from the rank holding what each receiver loads (``model_bytes``: the
    whole model, or a tensor-parallel rank's part of it, fed by a chain of its own) to ``receivers``
    ranks: ``model_bytes / link + (receivers - 1) * chunk_bytes / link`` — the bytes cross the slowest
    link once, and the last receiver starts one chunk per hop late. (Gathering them onto the first rank
    comes on top, as for the naive broadcast, and is left out of both.)"""
    return model_bytes / link_bytes_per_s + (receivers - 1) * chunk_bytes / link_bytes_per_s


def _full_on(rank: int, params: list[ParamMeta]) -> list[Holding]:
    """The naive baseline's layout: one rank holds every parameter whole."""
    return [Holding(rank, p.name, full_box(p.shape)) for p in params]


SIMULATED = {  # model → allocation (the 30B one is examples/ascend-qwen3-30b-a3b.yaml's)
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)"),
    "qwen3-235b-a22b": (QWEN3_235B_A22B, "vllm:d2t16+megatron:(attn:d4p8t4|ffn:d1p8e16)"),
    # rollout-heavy, as agentic runs are: 8 inference nodes for 2 trainer nodes (where relaying pays)
    "qwen3-30b-a3b-rollout-heavy": (QWEN3_30B_A3B, "vllm:d16t4+megatron:(attn:d1p4t4|ffn:d1p4e4)"),
}


def simulate(args: argparse.Namespace) -> dict:
    result: dict = {}
    for name, (shape, allocation) in SIMULATED.items():
        if name == "qwen3-235b-a22b" and args.skip_235b:
            continue
        log(f"planning {name}: {allocation}, 8 accelerators per node, {args.nic_gbit:g} Gb/s per NIC ...")
        case = simulate_case(shape, allocation, 8, args.nic_gbit)
        log(json.dumps(case))
        if name == "qwen3-30b-a3b":
            result = {"case": name, **case}
        else:
            result[name] = case
    return result


# ---- the real run: worker processes ---------------------------------------------------------


def build_model(args: argparse.Namespace, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=True)  # fmt: skip
    return Qwen2ForCausalLM(config)


def schedule_for(mode: str, metas: list[ParamMeta], n_train: int, world: int, joiners: int,
                 topology: dict[int, RankTopology]):
    """The planner's schedule of ``mode``: trainer ranks first, then the replicas, the ``joiners`` last
    (join modes only). ``broadcast``/``pipelined`` keep only its lower bound (the model once per
    replica from rank 0), for the record."""
    itemsize = {m.name: m.itemsize for m in metas}
    if mode in JOIN_MODES:
        needs = inference_needs(metas, [[r] for r in range(world - joiners, world)])
        peers = range(n_train, world - joiners)
        holdings = (fsdp2_holdings(metas, list(range(n_train))) if mode == "join-trainers"
                    else [h for peer in peers for h in _full_on(peer, metas)])
        return plan(holdings, needs, topology, itemsize)
    needs = inference_needs(metas, [[r] for r in range(n_train, world)])
    if mode == "p2p":
        return plan(fsdp2_holdings(metas, list(range(n_train))), needs, topology, itemsize)
    if mode == "p2p-relay":
        return relayed_plan(fsdp2_holdings(metas, list(range(n_train))), needs, topology, itemsize)
    return plan(_full_on(0, metas), needs, topology, itemsize)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from kuberl.collectives import exit_without_teardown
    from kuberl.weights.transport import local_tensor, open_group, param_metas, run_exchange, run_staged

    spec = json.loads(os.environ["KRL_BENCH"])
    rank, n_train, world, joiners = spec["rank"], spec["trainers"], spec["world"], spec["joiners"]
    model = build_model(args)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    metas = param_metas(base)
    topology = {int(r): RankTopology(node=n, zone="bench") for r, n in spec["nodes"].items()}
    schedule = schedule_for(args.mode, metas, n_train, world, joiners, topology)
    direct = schedule_for("p2p", metas, n_train, world - joiners, 0, topology)  # the bound p2p is held to
    link = Bandwidths.uniform(args.link_mbit * 1e6 / 8)
    holders = range(n_train, world - joiners) if args.mode == "join-peers" else range(0)  # replicas that send
    receivers = range(world - joiners, world) if args.mode in JOIN_MODES else range(n_train, world)
    dests: dict[str, torch.Tensor] = {}
    if rank < n_train:
        dist.init_process_group("gloo", init_method=f"tcp://{spec['store']}:{TRAIN_PORT}", rank=rank,
                                world_size=n_train)  # fmt: skip
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        shards = {name: local_tensor(p) for name, p in model.named_parameters()}
        base_shards = {name: t.clone() for name, t in shards.items()}
    else:
        dests = {m.name: torch.zeros(m.shape) for m in metas}
    pg = open_group(spec["store"], EXCHANGE_PORT, rank, world, bind_host=spec["bind"], timeout_s=600)
    seconds, identical, stats = [], True, None
    for sync in range(args.warmup + args.repeats):
        if rank < n_train:
            for name, t in shards.items():
                t.copy_(base_shards[name] + sync)
        elif rank in holders:  # a replica that already serves this version
            for name, t in dests.items():
                t.copy_(base[name] + sync)
        else:
            for t in dests.values():
                t.zero_()
        pg.barrier().wait()
        start = time.perf_counter()
        sources = shards if rank < n_train else dests if rank in holders else {}
        if args.mode in ("broadcast", "pipelined") and rank < n_train:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sources = full if rank == 0 else {}
        if args.mode == "pipelined":
            stats = chain_broadcast(pg, [0, *range(n_train, world)], rank, metas, sources, dests)
        elif isinstance(schedule, StagedPlan):
            stats = run_staged(pg, schedule.for_rank(rank), rank, sources, dests, schedule.relay_sources.get(rank, []))
        else:
            stats = run_exchange(pg, schedule.for_rank(rank), rank, sources, dests)
        pg.barrier().wait()
        elapsed = time.perf_counter() - start
        if sync >= args.warmup:
            seconds.append(elapsed)
        if rank in receivers:
            same = all(torch.equal(dests[name], base[name] + sync) for name in base)
            identical = identical and same
        if rank == 0:
            log(f"  {args.mode} sync {sync}{' (warm-up)' if sync < args.warmup else ''}: {elapsed:.2f} s")
    result = {"rank": rank, "role": "trainer" if rank < n_train else "replica", "seconds": seconds,
              "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
              "identical": identical if rank in receivers else None,
              "lower_bound_bytes": direct.lower_bound_seconds,  # uniform bandwidth 1: seconds = bytes
              "predicted_seconds_at_link_rate": (schedule.predicted_seconds(link) if isinstance(schedule, StagedPlan)
                                                 else predicted_seconds(schedule, link))}  # fmt: skip
    Path(spec["out"], f"{rank}.json").write_text(json.dumps(result))
    if rank < n_train:
        dist.destroy_process_group()
    exit_without_teardown(0)


@dataclass
class ChainStats:
    bytes_sent: int = 0
    bytes_received: int = 0


def chain_broadcast(pg, chain: list[int], rank: int, metas, sources: dict, dests: dict) -> ChainStats:
    """The pipelined broadcast: ``chain[0]`` packs the whole model into one buffer and sends it in
    ``CHUNK_BYTES`` chunks to ``chain[1]``, which forwards each chunk to ``chain[2]`` as soon as it
    has it (its sends in flight while it receives the next), and so on; each receiver unpacks into
    ``dests``. A rank not in the chain does nothing."""
    import torch

    if rank not in chain:
        return ChainStats()
    at = chain.index(rank)
    before, after = (chain[at - 1] if at else None), (chain[at + 1] if at + 1 < len(chain) else None)
    sizes = [math.prod(m.shape) for m in metas]
    numel = sum(sizes)
    if before is None:
        buffer = torch.cat([sources[m.name].reshape(-1).to(torch.float32) for m in metas])
    else:
        buffer = torch.empty(numel, dtype=torch.float32)
    step = CHUNK_BYTES // buffer.element_size()
    sends, stats = [], ChainStats()
    for tag, start in enumerate(range(0, numel, step)):
        chunk = buffer[start:start + step]
        if before is not None:
            pg.recv([chunk], before, tag).wait()
            stats.bytes_received += chunk.numel() * chunk.element_size()
        if after is not None:
            sends.append(pg.send([chunk], after, tag))
            stats.bytes_sent += chunk.numel() * chunk.element_size()
    for work in sends:
        work.wait()
    if before is not None:
        offset = 0
        for m, size in zip(metas, sizes, strict=True):
            dests[m.name].copy_(buffer[offset:offset + size].view(m.shape))
            offset += size
    return stats


# ---- orchestration --------------------------------------------------------------------------


def run_mode(args: argparse.Namespace, mode: str, nodes, out: Path) -> dict:
    """Start every rank (trainer ranks on trainer nodes, one replica per replica node) for one mode."""
    n_train = args.trainer_nodes * args.ranks_per_node
    joiners = args.joiners if mode in JOIN_MODES else 0
    world = n_train + args.replica_nodes + joiners
    node_of = [i // args.ranks_per_node for i in range(n_train)]
    node_of += [args.trainer_nodes + r for r in range(args.replica_nodes + joiners)]
    names = {r: (nodes[node_of[r]].name if nodes else f"node{node_of[r]}") for r in range(world)}
    store = nodes[0].address if nodes else "127.0.0.1"
    before = [(n.bytes_sent(), n.bytes_received()) for n in nodes] if nodes else []
    procs = []
    for rank in range(world):
        node = nodes[node_of[rank]] if nodes else None
        spec = {"rank": rank, "world": world, "trainers": n_train, "joiners": joiners, "nodes": names, "store": store,
                "bind": node.address if node else "127.0.0.1", "out": str(out)}  # fmt: skip
        env = {**os.environ, "KRL_BENCH": json.dumps(spec), "GLOO_SOCKET_IFNAME": "eth0" if node else "lo",
               "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}  # fmt: skip
        argv = [sys.executable, __file__, "--worker", "--mode", mode, *args.model_argv]
        procs.append(subprocess.Popen(node.command(argv) if node else argv, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{mode}: worker exit codes {codes}")
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
    syncs = args.warmup + args.repeats
    links = {}
    if nodes:
        for i, n in enumerate(nodes):
            sent, recv = n.bytes_sent() - before[i][0], n.bytes_received() - before[i][1]
            links[n.name] = {"sent_per_sync": sent // syncs, "received_per_sync": recv // syncs}
    per_process = {r["rank"]: {"sent": r["bytes_sent"], "received": r["bytes_received"]} for r in ranks}
    return {
        "seconds": statistics.median(ranks[0]["seconds"]),
        "all_seconds": [round(s, 3) for s in ranks[0]["seconds"]],
        "bit_identical": all(r["identical"] for r in ranks if r["identical"] is not None),  # every receiver's
        "bytes_per_process": per_process,
        "busiest_process_bytes": max(v["sent"] + v["received"] for v in per_process.values()),
        "lower_bound_bytes": int(ranks[0]["lower_bound_bytes"]),
        "link_bytes_per_node": links,
        "busiest_link_bytes": max((max(v.values()) for v in links.values()), default=None),
        "predicted_seconds": round(ranks[0]["predicted_seconds_at_link_rate"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer-nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=1, help="trainer ranks per trainer node")
    parser.add_argument("--replica-nodes", type=int, default=4)
    parser.add_argument("--joiners", type=int, default=1, help="the join case: new replicas, each on a node")
    parser.add_argument("--link-mbit", type=float, default=500.0, help="each node's link, per direction")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or shaping (plain loopback)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--simulate", action="store_true", help="planner + cost model at cluster scale only")
    parser.add_argument("--nic-gbit", type=float, default=400.0, help="--simulate: per-accelerator NIC")
    parser.add_argument("--skip-235b", action="store_true", help="--simulate: only the 30B cases")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="p2p", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_argv = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--intermediate",
                       str(args.intermediate), "--vocab", str(args.vocab), "--warmup", str(args.warmup),
                       "--repeats", str(args.repeats), "--link-mbit", str(args.link_mbit)]  # fmt: skip
    if args.worker:
        return worker(args)
    if args.simulate:
        result = simulate(args)
        out = args.out or ROOT / "results" / "weight_sync_simulated.json"
    else:
        result = emulate(args)
        out = args.out or ROOT / "results" / "weight_sync.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def emulate(args: argparse.Namespace) -> dict:
    model_bytes = sum(p.numel() * p.element_size() for p in build_model(args).parameters())
    total_nodes = args.trainer_nodes + args.replica_nodes + args.joiners
    log(f"model {model_bytes / 1e6:.0f} MB; {args.trainer_nodes} trainer nodes x {args.ranks_per_node} ranks, "
        f"{args.replica_nodes} replica nodes, links {args.link_mbit:g} Mbit/s")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        nodes, emulation = [], "loopback"
        try:
            if args.loopback:
                raise NetemUnavailable("--loopback was given")
            nodes, emulation = stack.enter_context(emulated_cluster(total_nodes, args.link_mbit)), "netns+tc"
        except NetemUnavailable as why:
            log(f"WARNING: no emulated network ({why}); plain loopback: all ranks share one host, no link shaping")
        modes = {}
        for mode in MODES + JOIN_MODES:
            log(f"{mode}:")
            workdir = Path(tmp, mode)
            workdir.mkdir()
            modes[mode] = run_mode(args, mode, nodes, workdir)
    p2p, broadcast, pipelined = modes["p2p"], modes["broadcast"], modes["pipelined"]
    return {
        "emulation": emulation,
        "link_mbit": args.link_mbit if nodes else None,
        "trainer_nodes": args.trainer_nodes,
        "trainer_ranks": args.trainer_nodes * args.ranks_per_node,
        "replica_nodes": args.replica_nodes,
        "model_bytes": model_bytes,
        "seconds": {mode: round(modes[mode]["seconds"], 3) for mode in MODES},
        "speedup": round(broadcast["seconds"] / p2p["seconds"], 2),
        "speedup_vs_pipelined": round(pipelined["seconds"] / p2p["seconds"], 2),
        "relay": {"seconds": round(modes["p2p-relay"]["seconds"], 3),
                  "predicted_seconds": modes["p2p-relay"]["predicted_seconds"],
                  "p2p_predicted_seconds": p2p["predicted_seconds"],
                  "chosen_by_the_planner": relay_pays(modes["p2p-relay"]["predicted_seconds"],
                                                      p2p["predicted_seconds"]),
                  "speedup_vs_p2p": round(p2p["seconds"] / modes["p2p-relay"]["seconds"], 2),
                  "speedup_vs_pipelined": round(pipelined["seconds"] / modes["p2p-relay"]["seconds"], 2)},
        "bit_identical": all(modes[mode]["bit_identical"] for mode in MODES + JOIN_MODES),
        "join": {"joiners": args.joiners, **{mode: {"seconds": round(modes[mode]["seconds"], 3),
                                                    "predicted_seconds": modes[mode]["predicted_seconds"]}
                                             for mode in JOIN_MODES},
                 "speedup_peers_vs_trainers": round(modes["join-trainers"]["seconds"] / modes["join-peers"]["seconds"],
                                                    2)},
        "busiest_process_bytes": {mode: modes[mode]["busiest_process_bytes"] for mode in MODES},
        "lower_bound_bytes": p2p["lower_bound_bytes"],
        "p2p_busiest_over_lower_bound": round(p2p["busiest_process_bytes"] / p2p["lower_bound_bytes"], 4),
        "busiest_link_bytes_per_sync": {mode: modes[mode]["busiest_link_bytes"] for mode in MODES},
        "modes": modes,
    }


if __name__ == "__main__":
    main()
