"""Tokens per second of an actor's training step (FSDP2, or Megatron with ``--backend megatron``),
rows padded vs packed, on a ragged batch.

The batch: ``--rows`` trajectories whose lengths follow a log-normal law (median ``--median``
tokens, σ ``--sigma``, capped at ``--longest``; one row is always the longest) — the long tail of
reasoning and agent episodes. Both actors start from the same tiny Qwen2 (``--hidden``, ``--layers``)
and take ``--steps`` full ``train_step``s (the same micro-batches, by the default token budget;
packed, each one's rows fill fewer rows) after one warm-up step; reported: real tokens per second (median step), the
tokens each layout computes on, and the loss of the first step (equal: the same update).

    python benchmarks/packing.py [--backend fsdp|megatron --rows 64 --median 150 --sigma 0.8 --longest 2048 --steps 3]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lengths(rows: int, median: int, sigma: float, longest: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    drawn = [min(longest, max(8, round(rng.lognormvariate(0.0, sigma) * median))) for _ in range(rows - 1)]
    return [longest, *drawn]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--median", type=int, default=150)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--longest", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from kuberl.fsdp.actor import FSDPActor
    from kuberl.local.processes import free_port
    from kuberl.megatron.actor import MegatronActor
    from kuberl.models.tiny import tiny_qwen2
    from kuberl.policy.algorithms import AlgorithmConfig
    from kuberl.policy.batch import collate, padded_tokens
    from kuberl.policy.packing import packed_tokens
    from kuberl.rollout.types import Trajectory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.backend == "megatron":
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1, 1)
    vocab, rng = 512, random.Random(args.seed)
    sizes = lengths(args.rows, args.median, args.sigma, args.longest, args.seed)
    trajs = []
    for n in sizes:
        prompt = max(2, n // 4)
        out = [rng.randrange(4, vocab) for _ in range(n - prompt)]
        trajs.append(Trajectory([2] + [rng.randrange(4, vocab) for _ in range(prompt - 1)], out,
                                [-6.0] * len(out), [0] * len(out)))
    batch = collate(trajs, [rng.gauss(0.0, 1.0) for _ in trajs], 0)
    real = int(batch.attention_mask.sum())
    config = AlgorithmConfig(name="grpo", group_size=4)
    result: dict[str, object] = {
        "rows": args.rows, "real_tokens": real, "padded_batch_tokens": padded_tokens(sizes),
        "lengths": {"median": statistics.median(sizes), "mean": round(statistics.mean(sizes), 1), "max": max(sizes)},
        "backend": args.backend, "model": {"hidden": args.hidden, "layers": args.layers, "vocab": vocab},
        "threads": torch.get_num_threads(),
    }
    for layout in ("padded", "packed"):
        torch.manual_seed(args.seed)
        model = tiny_qwen2(vocab, seed=args.seed, hidden=args.hidden, layers=args.layers)
        make = FSDPActor.create if args.backend == "fsdp" else MegatronActor.from_hf
        actor = make(model, config, lr=1e-5, temperature=1.0, packing=layout == "packed")
        chunks = actor._micro_batches(batch)
        computed = sum((packed_tokens if layout == "packed" else padded_tokens)([int(n) for n in c.lengths])
                       for c in chunks)
        seconds, first_loss = [], None
        for step in range(args.steps + 1):
            start = time.perf_counter()
            stats = actor.train_step(batch, batch.size)
            if step == 0:
                first_loss = stats["ppo_actor/loss"]
            else:
                seconds.append(time.perf_counter() - start)
            log(f"{layout}: step {step} {time.perf_counter() - start:.2f} s")
        result[layout] = {"micro_batches": len(chunks), "computed_tokens": computed,
                          "step_seconds": round(statistics.median(seconds), 3),
                          "tokens_per_second": round(real / statistics.median(seconds)),
                          "first_step_loss": first_loss}
    result["speedup"] = round(result["packed"]["tokens_per_second"] / result["padded"]["tokens_per_second"], 2)
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
