"""Weight sync at many receivers, simulated: where the planner's p2p schedule beats a pipelined (chained,
chunked) broadcast, where it does not, and what the planner chooses (issue 70, item 5).

The baseline is NeMo-RL's measured case: a dense model of 8.8 GB in bfloat16 (Qwen3-4B-sized) pushed
from one trainer node of 8 GPUs (FSDP, each rank an eighth of every tensor) to 4, 16 and 32 receivers —
single-GPU replicas, 8 per node — one 400 Gb/s NIC per GPU (NeMo-RL reports 0.18–0.22 s for 32 GPUs inside
Kubernetes with NCCL's broadcast). The same sweep for Qwen3-30B-A3B (61 GB) to 4-GPU tensor-parallel
replicas from its example's Megatron layout. For each case, predicted by the planner's cost model
(:func:`kuberl.weights.plan.predicted_seconds`, ports at NIC rate, NVLink-class links inside a node):

- ``p2p``: every trainer rank sends its own shard to every receiver that needs it (the product's default);
- ``p2p-relay``: each distinct piece to one seed replica, which forwards it (``spec.weightSync.relay``), and
  whether the planner would take it (``relay_chosen``: predicted ≥ 10 % faster);
- ``pipelined``: the whole model gathered on one rank (a tensor-parallel rank's part on one rank per part),
  then down a chain of replicas in 4 MiB chunks — every link carries it once
  (:func:`weight_sync.pipelined_broadcast_seconds`; the gather excluded, in its favour);
- ``broadcast``: the product's broadcast mode (rank 0 sends the whole model to every receiver).

``fastest`` names the fastest of them; ``planner`` what the planner runs (p2p or p2p-relay, the latter only
where it pays). Measured on CPU: ``benchmarks/weight_sync.py`` (2 cores cannot host 32 receivers).

    python benchmarks/weight_sync_scale.py [--receivers 4 16 32] [--nic-gbit 400] [--out FILE]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent / "workload"), str(ROOT)]

from weight_sync import pipelined_broadcast_seconds, simulated_cluster  # noqa: E402

from kuberl.api.allocation import parse_allocation  # noqa: E402
from kuberl.weights.layouts import (  # noqa: E402
    QWEN3_30B_A3B,
    MoEShape,
    ParamMeta,
    fsdp2_holdings,
    inference_needs,
    megatron_holdings,
)
from kuberl.weights.plan import Holding, full_box, plan, predicted_seconds  # noqa: E402
from kuberl.weights.relay import relay_pays, relayed_plan  # noqa: E402

PER_NODE = 8
# Qwen3-4B-sized and dense (8.8 GB in bfloat16): one "expert" stands for the dense MLP — the same bytes,
# split alike by FSDP's first dimension and by a TP-1 replica (which splits nothing)
DENSE_8_8GB = MoEShape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, experts=1, moe_intermediate=9728,
                       vocab=151936)
CASES = {  # name → (shape, trainer allocation, inference tensor parallelism)
    "dense-8.8GB-fsdp8": (DENSE_8_8GB, "fsdp:d8", 1),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "megatron:(attn:d2p4t4|ffn:d1p4e8)", 4),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def trainer_holdings(params: list[ParamMeta], shape: MoEShape, allocation: str) -> tuple[list[Holding], int]:
    """What each trainer rank holds, and how many ranks there are."""
    if allocation.startswith("fsdp:d"):
        ranks = list(range(int(allocation.removeprefix("fsdp:d"))))
        return fsdp2_holdings(params, ranks), len(ranks)
    trainer = parse_allocation(f"vllm:d1t1+{allocation}").trainer
    ranks = list(range(trainer.devices))
    return megatron_holdings(params, ranks, trainer, shape.layers, shape.experts), len(ranks)


def case(shape: MoEShape, allocation: str, tensor: int, receivers: int, nic_gbit: float) -> dict:
    """One row: ``receivers`` accelerators in replicas of ``tensor`` ranks after the trainer's ranks."""
    params = shape.params()
    holdings, trainers = trainer_holdings(params, shape, allocation)
    replicas = [[trainers + r * tensor + t for t in range(tensor)] for r in range(receivers // tensor)]
    needs = inference_needs(params, replicas, fuse=True)
    ranks, bw = simulated_cluster(list(range(trainers + receivers)), PER_NODE, nic_gbit)
    nic = bw.zone
    itemsize = {p.name: p.itemsize for p in params}
    started = time.perf_counter()
    direct = predicted_seconds(plan(holdings, needs, ranks, itemsize, bw), bw)
    planning = time.perf_counter() - started
    relay = relayed_plan(holdings, needs, ranks, itemsize, bw).predicted_seconds(bw)
    model_bytes = sum(p.nbytes for p in params)
    naive = predicted_seconds(plan([Holding(0, p.name, full_box(p.shape)) for p in params], needs, ranks,
                                   itemsize, bw), bw)
    pipelined = pipelined_broadcast_seconds(model_bytes // tensor, len(replicas), nic)  # one chain per TP rank
    seconds = {"p2p": direct, "p2p-relay": relay, "pipelined": pipelined, "broadcast": naive}
    planner = "p2p-relay" if relay_pays(relay, direct) else "p2p"
    return {"receivers": receivers, "replicas": len(replicas), "model_gb": round(model_bytes / 1e9, 2),
            **{f"{mode}_seconds": round(s, 4) for mode, s in seconds.items()},
            "fastest": min(seconds, key=seconds.__getitem__), "planner": planner,
            "planner_over_pipelined": round(seconds[planner] / seconds["pipelined"], 2),
            "planning_seconds": round(planning, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--nic-gbit", type=float, default=400.0, help="per accelerator (default %(default)s)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result: dict = {"nic_gbit": args.nic_gbit, "accelerators_per_node": PER_NODE}
    for name in args.cases:
        shape, allocation, tensor = CASES[name]
        rows = []
        for receivers in args.receivers:
            log(f"{name}: {allocation} → {receivers} receivers (tensor parallel {tensor}) ...")
            rows.append(case(shape, allocation, tensor, receivers, args.nic_gbit))
            log(json.dumps(rows[-1]))
        result[name] = rows
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
