"""Routing replay (R3) against the engine–trainer mismatch on a mixture of experts, on this machine.

``examples/cpu-megatron-moe.yaml`` (Megatron-core, expert parallel 2 × data 2, the torch engine) in
bfloat16 at staleness 0 — so every gap between the engine's log-probs and the trainer's is numerics,
none staleness —, once with ``algorithm.routingReplay`` off and once on. The policy is a Qwen3-MoE
shape built here from ``--experts``, ``--top-k`` and ``--layers`` (the example's builtin has 4
experts, top 2, 2 layers; Qwen3-30B-A3B has 128, top 8, 48 layers) and saved as a Hugging Face
directory that both runs load (``spec.model.path``), so the two differ only in the switch.

In float32 the engine and the trainer compute the same numbers here; in bfloat16 Megatron's kernels
and the engine's (Hugging Face's) round differently, so a token whose k-th and (k+1)-th experts are
close in router score can be sent to different experts — what replay removes — and every token also
carries the rounding itself, which replay cannot remove (the floor a dense model has too).

Reported per run, from its summary: the mean over steps of ``mismatch/behav_logp_gap`` (mean
|log π_trainer − log π_engine| per token), its largest step, ``mismatch/k3_kl`` and ``mismatch/chi2``,
the training reward (first and last 10 steps); the off ÷ on ratios per seed (``--repeats N``: seeds
``seed`` … ``seed + N − 1``, each its own policy draw and run seed), and the ratios of the means over
seeds.

    python benchmarks/routing_replay.py [--steps 150] [--experts 4] [--top-k 2] [--layers 2] [--seed 0]
                                        [--repeats 1] [--set dotted.key=value ...]
                                        [--out benchmarks/results/routing_replay.json]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]

from common import add_out, report  # noqa: E402

from kuberl.local import run_local  # noqa: E402

EXAMPLE = ROOT / "examples/cpu-megatron-moe.yaml"
SETTINGS = ["model.dtype=bfloat16", "rollout.maxStaleness=0", "evaluation=null", "checkpoint.everySteps=1000"]


def save_policy(directory: Path, experts: int, top_k: int, layers: int, seed: int) -> None:
    """The example's tiny Qwen3-MoE (``kuberl.models.tiny.tiny_qwen3_moe``) with ``experts`` experts of
    which each token takes ``top_k``, in ``layers`` layers, seeded, and its character tokenizer, as an
    HF directory."""
    from kuberl.models.tiny import char_tokenizer, tiny_qwen3_moe

    tokenizer = char_tokenizer()
    tiny_qwen3_moe(len(tokenizer), seed, layers=layers, experts=experts, top_k=top_k).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def measured(summary: dict[str, Any]) -> dict[str, Any]:
    mismatch = summary["mismatch"]
    return {"behav_logp_gap_mean": summary["behav_logp_gap_mean"], "behav_logp_gap_max": summary["behav_logp_gap_max"],
            "k3_kl_mean": mismatch.get("k3_kl_mean"), "chi2_mean": mismatch.get("chi2_mean"),
            "reward_first10_mean": summary["reward_first10_mean"], "reward_last10_mean": summary["reward_last10_mean"],
            "step_seconds_mean": summary.get("timeperf/step_mean")}


def ratio(off: float | None, on: float | None) -> float | None:
    return round(off / on, 2) if off is not None and on else None


RATIOS = {"gap_off_over_on": "behav_logp_gap_mean", "gap_max_off_over_on": "behav_logp_gap_max",
          "k3_kl_off_over_on": "k3_kl_mean", "chi2_off_over_on": "chi2_mean"}


def replay_pair(args: argparse.Namespace, seed: int, scratch: Path) -> dict[str, Any]:
    """One seed: the policy saved, then its run with routing replay off and on; each run's measures and
    the off ÷ on ratios."""
    model = scratch / f"policy-{seed}"
    save_policy(model, args.experts, args.top_k, args.layers, seed)
    runs: dict[str, Any] = {"seed": seed}
    for name, replay in (("off", "false"), ("on", "true")):
        print(f"seed {seed}, routing replay {name}: {args.steps} steps …", file=sys.stderr, flush=True)
        overrides = [f"model.path={model}", f"algorithm.routingReplay={replay}", f"seed={seed}", *SETTINGS,
                     *args.sets]
        summary = run_local(EXAMPLE, overrides, args.steps, None, workdir=scratch / f"{name}-{seed}", quiet=True)
        runs[name] = measured(summary)
        print(f"  {json.dumps(runs[name])}", file=sys.stderr, flush=True)
    return runs | {key: ratio(runs["off"][field], runs["on"][field]) for key, field in RATIOS.items()}


def over_seeds(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's mean over the seeds (off and on), the ratio of those means, and the per-seed
    ratios' range: one run's KL moves by tens of % between identical runs, so one pair is weak evidence."""
    means = {mode: {field: round(statistics.fmean(p[mode][field] for p in pairs), 7) for field in pairs[0][mode]}
             for mode in ("off", "on")}
    return {"mean": means, **{key: {"of_means": ratio(means["off"][field], means["on"][field]),
                                    "per_seed": [p[key] for p in pairs]} for key, field in RATIOS.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="seeds seed, seed + 1, …: one off/on pair each")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="another manifest override")
    add_out(parser, "routing_replay")
    args = parser.parse_args()
    if args.experts % 2 or not 1 <= args.top_k <= args.experts:
        parser.error("--experts must be even (expert parallel 2) and --top-k within 1..experts")
    with tempfile.TemporaryDirectory(prefix="kuberl-r3-") as scratch:
        pairs = [replay_pair(args, seed, Path(scratch)) for seed in range(args.seed, args.seed + args.repeats)]
    result = {
        "command": f"python benchmarks/routing_replay.py --steps {args.steps} --experts {args.experts} "
                   f"--top-k {args.top_k} --layers {args.layers} --seed {args.seed} --repeats {args.repeats}"
                   + "".join(f" --set {s}" for s in args.sets),
        "model": {"experts": args.experts, "top_k": args.top_k, "layers": args.layers},
        "settings": SETTINGS, **over_seeds(pairs), "pairs": pairs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
