"""Peak memory and time of a Megatron training step on long rows, context parallelism 1 vs 2.

One or two ranks over gloo train the same ``--rows`` rows of ``--length`` tokens (a tiny Qwen2:
``--hidden``, ``--layers``; 4 query heads, 2 key-value heads) with the Megatron actor: context 1 is one rank holding the
rows whole; context 2 is two ranks, each holding half of every row's positions (Megatron's
load-balanced chunks) and gathering keys and values. Reported per layout: the step's seconds (median
of ``--steps`` after one warm-up step), the peak resident memory a rank added during the steps (its
``ru_maxrss`` after minus before: activations, attention scores, gathered k/v; the model and
optimizer were built before), and the first step's loss and gradient norm (the same update).

    python benchmarks/context_parallel.py [--length 4096 --rows 1 --hidden 256 --layers 4 --steps 2]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank: build the actor, train ``args.steps`` + 1 steps on the long rows, save what it measured."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from kuberl.megatron.actor import MegatronActor
    from kuberl.models.tiny import tiny_qwen2
    from kuberl.policy.algorithms import AlgorithmConfig
    from kuberl.policy.batch import collate
    from kuberl.rollout.types import Trajectory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    model = tiny_qwen2(512, seed=args.seed, hidden=args.hidden, layers=args.layers)
    model.config.max_position_embeddings = args.length  # rotary: no learned table to outgrow
    actor = MegatronActor.from_hf(model, AlgorithmConfig(name="grpo", group_size=1), lr=1e-5, temperature=1.0)
    actor.token_budget = args.rows * args.length  # the rows in one micro-batch, as one long row would be
    g = torch.Generator().manual_seed(args.seed)
    trajs = []
    for _ in range(args.rows):
        ids = torch.randint(4, 512, (args.length,), generator=g).tolist()
        prompt = args.length // 4
        trajs.append(Trajectory(ids[:prompt], ids[prompt:], [-6.0] * (args.length - prompt),
                                [0] * (args.length - prompt)))
    batch = collate(trajs, torch.randn(args.rows, generator=g).tolist(), 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, first = [], {}
    for step in range(args.steps + 1):
        start = time.perf_counter()
        stats = actor.train_step(batch, batch.size)
        if step == 0:
            first = {"loss": stats["ppo_actor/loss"], "grad_norm": stats["ppo_actor/grad_norm"]}
        else:
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            log(f"context {world}: step {step} {time.perf_counter() - start:.2f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    measured = [None] * world
    dist.all_gather_object(measured, {"peak_added_mib": round(peak / 1024, 1)})
    if rank == 0:
        Path(out).write_text(json.dumps({"step_seconds": round(statistics.median(seconds), 3),
                                         "peak_added_mib_per_rank": [m["peak_added_mib"] for m in measured],
                                         "first_step": first}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from kuberl.local.processes import free_port

    result: dict[str, object] = {"length": args.length, "rows": args.rows,
                                 "model": {"hidden": args.hidden, "layers": args.layers, "heads": 4,
                                           "vocab": 512}, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as scratch:
        for context in (1, 2):
            out = str(Path(scratch) / f"context{context}.json")
            mp.start_processes(worker, args=(context, free_port(), args, out), nprocs=context, start_method="spawn")
            result[f"context{context}"] = json.loads(Path(out).read_text())
    one, two = result["context1"], result["context2"]
    result["peak_ratio"] = round(max(two["peak_added_mib_per_rank"]) / max(one["peak_added_mib_per_rank"]), 3)
    result["time_ratio"] = round(two["step_seconds"] / one["step_seconds"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
