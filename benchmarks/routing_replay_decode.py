"""Routing replay (R3) against the one engine–trainer mismatch left on this machine: the decode step.

``benchmarks/routing_replay.py`` runs the MoE example, whose answers are a token or two: there the torch
engine's bfloat16 log-probs equal the trainer's and replay has nothing to remove. Longer answers reach a
difference that stays — the engine computes a token's attention as one query over its KV cache, the
trainer as one row of a whole-sequence forward, and torch's fused bfloat16 attention rounds the two
differently (GPUs: flash attention's split-KV, the same story). Those roundings move router scores, and
where a token's k-th and (k+1)-th experts were close the trainer routes it elsewhere: what replay removes.

Here, no training: a Qwen3-MoE shape (``--experts``, ``--top-k``, ``--layers``; seeded) in bfloat16, the
real torch engine (``kuberl.inference.engine.TorchEngine``, batched, left-padded, KV-cached) samples
``--new-tokens`` tokens for ``--prompts`` random prompts with their routes, and the trainer's scorer
(``kuberl.policy.actor.token_logprobs_and_entropy``, the FSDP2 path; Megatron's bfloat16 forward equals it
bit for bit) reads the samples' log-probs without and with the engine's routes. Per seed and shape:

- ``rerouted``: the fraction of generated tokens for which some layer's expert set differs (trainer vs engine);
- ``gap``: mean |log π_trainer − log π_engine| per token, off and on; ``gap_rerouted`` / ``gap_same``: the same
  over the rerouted tokens and over the rest (replay off) — what a flip costs against the rounding floor;
- ``max_gap``, ``k3_kl`` (mean of exp(r) − 1 − r, r = log π_engine − log π_trainer), ``over_0.01`` (the
  fraction of tokens off by more than 0.01), off and on.

    python benchmarks/routing_replay_decode.py [--experts 32] [--top-k 4] [--layers 4] [--new-tokens 64]
                                               [--prompts 32] [--seeds 3] [--out ...]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]

from common import add_out, report  # noqa: E402

from kuberl.devices import placed  # noqa: E402
from kuberl.inference.contract import Generation, SamplingParams  # noqa: E402
from kuberl.inference.engine import TorchEngine, generate_all  # noqa: E402
from kuberl.models import moe_routing  # noqa: E402
from kuberl.models.tiny import tiny_qwen3_moe  # noqa: E402
from kuberl.policy.actor import token_logprobs_and_entropy  # noqa: E402
from kuberl.policy.batch import Batch, collate  # noqa: E402
from kuberl.rollout.types import Trajectory  # noqa: E402

VOCAB = 64
EOS, PAD, BOS = 1, 0, 2


def random_prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 3–11 random tokens after BOS (batched, they are left-padded to the longest)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator).tolist()
    return [[BOS, *torch.randint(3, VOCAB, (n,), generator=generator).tolist()] for n in lengths]


def sampled(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, seed: int) -> list[Generation]:
    engine = TorchEngine(model, eos_id=EOS, pad_id=PAD, seed=seed)
    return generate_all(engine, prompts, SamplingParams(max_new_tokens=new_tokens, return_routes=True))


def scored(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's log-probs without the routes, with them, and its own routes [B, L, layers, k]."""
    plain = dataclasses.replace(batch, routes=batch.routes[:, :, :0])
    with torch.no_grad():
        with moe_routing.recording(model) as recorded:
            own_logp, _ = token_logprobs_and_entropy(model, plain, 1.0)
        replayed_logp, _ = token_logprobs_and_entropy(model, batch, 1.0)
    own_routes = moe_routing.stacked(recorded, batch.routes.shape[2], batch.size)
    return own_logp.float(), replayed_logp.float(), own_routes


def measures(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> dict[str, float]:
    r = engine_logp - trainer_logp
    return {"gap": r.abs().mean().item(), "max_gap": r.abs().max().item(),
            "k3_kl": (torch.exp(r) - 1 - r).mean().item(), "over_0.01": (r.abs() > 0.01).float().mean().item()}


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    model = tiny_qwen3_moe(VOCAB, seed, layers=args.layers, experts=args.experts, top_k=args.top_k).eval()
    model = placed(model, torch.device("cpu"), torch.bfloat16)
    prompts = random_prompts(args.prompts, seed)
    generations = sampled(model, prompts, args.new_tokens, seed)
    batch = collate([Trajectory(p, g.output_ids, g.logprobs, g.versions, routes=g.routes)
                     for p, g in zip(prompts, generations, strict=True)], [0.0] * len(prompts), 0)
    own_logp, replayed_logp, own_routes = scored(model, batch)
    tokens = batch.loss_mask > 0  # [B, L − 1]: the generated tokens as targets
    engine_routes = batch.routes.to(torch.int64).sort(dim=-1).values
    differs = (engine_routes != own_routes.to(torch.int64).sort(dim=-1).values).any(dim=-1).any(dim=-1)
    rerouted = differs[:, :-1] & tokens  # target j is sampled from position j's forward
    engine = batch.behav_logp
    result = {"seed": seed, "tokens": int(tokens.sum()), "rerouted": rerouted.sum().item() / tokens.sum().item(),
              "gap_rerouted": (own_logp - engine)[rerouted].abs().mean().item() if rerouted.any() else None,
              "gap_same": (own_logp - engine)[tokens & ~rerouted].abs().mean().item(),
              "off": measures(engine[tokens], own_logp[tokens]), "on": measures(engine[tokens], replayed_logp[tokens])}
    print(f"  seed {seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def mean_of(runs: list[dict[str, Any]], mode: str, field: str) -> float:
    return statistics.fmean(run[mode][field] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 … N − 1: one policy draw and one sample each")
    add_out(parser, "routing_replay_decode")
    args = parser.parse_args()
    print(f"{args.experts} experts, top {args.top_k}, {args.layers} layers, {args.new_tokens} new tokens",
          file=sys.stderr, flush=True)
    runs = [one_seed(args, seed) for seed in range(args.seeds)]
    fields = ("gap", "max_gap", "k3_kl", "over_0.01")
    means = {mode: {field: round(mean_of(runs, mode, field), 8) for field in fields} for mode in ("off", "on")}
    result = {
        "command": f"python benchmarks/routing_replay_decode.py --experts {args.experts} --top-k {args.top_k} "
                   f"--layers {args.layers} --new-tokens {args.new_tokens} --prompts {args.prompts} "
                   f"--seeds {args.seeds}",
        "rerouted_mean": round(statistics.fmean(run["rerouted"] for run in runs), 5),
        "mean": means,
        "off_over_on": {field: round(means["off"][field] / means["on"][field], 2) if means["on"][field] else None
                        for field in fields},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
