"""Asynchronous vs synchronous RL on this machine: the same experiment with η = 0 and η ≥ 2.

One inference replica and one trainer rank, each pinned to its own CPU core (as disaggregated pools
are), the same number of trained samples (steps × batch size). Synchronous RL alternates: the
replica generates the batch for version v while the trainer waits, then the trainer trains while
the replica waits. Asynchronous RL overlaps them, so a step costs max(generate, train) instead of
their sum; the synchronous run's two phases (generate G, train T per step) are reported too.

The default task is 3-digit addition with partial credit (``digit_match``): its answers are long
enough that generating a batch costs about as much as training on it, the regime where overlap
pays most. Final reward = mean over the last 20 % of steps; "not worse" allows two standard errors.
``--repeats N`` runs N seed pairs (seed s, s+1, …; each seed once synchronous, once asynchronous) and
reports the mean reward over seeds, with the standard errors combined, and the speedup of the summed
wall-clock times; one seed's reward at 150 steps varies by a few points between seeds. Those errors
are within runs; ``reward_difference_paired`` (mean async − sync over seeds, and its standard error
from the seeds' spread) also carries how much a seed's run varies between identical runs.

    python benchmarks/async_vs_sync.py [--steps 150] [--staleness 2] [--repeats 1] [--seed 0]
                                       [--set dotted.key=value ...]
                                       [--out benchmarks/results/async_vs_sync.json]

``--set`` overrides a setting below (or any other manifest field) in both runs, e.g.
``--set dataset.path=builtin:arithmetic-2digit --set rollout.maxNewTokens=4``.

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]

from common import add_out, report  # noqa: E402

from kuberl.local import apply_overrides, run_local  # noqa: E402
from kuberl.local.processes import RunError  # noqa: E402

SETTINGS = {
    "dataset.path": "builtin:arithmetic-3digit",
    "reward.function": "kuberl.rewards:digit_match",
    "rollout.maxNewTokens": 5,  # the longest answer (4 digits) + end of sequence
    "inference.replicas": 1,
    "trainer.nodes": 1,
    "trainer.acceleratorsPerNode": 1,
    # The example checkpoints every 10 steps to demonstrate recovery; at ~70 ms per save, which blocks
    # the trainer in both modes alike, that is ~6 % of an asynchronous step. Real runs save every
    # 50-100 steps; `--set checkpoint.everySteps=10` measures the example's cadence.
    "checkpoint.everySteps": 100,
}


def tail_stats(rewards: list[float]) -> tuple[float, float]:
    """Mean and standard error of the last 20 % of per-step rewards."""
    tail = rewards[-max(2, len(rewards) // 5):]
    return statistics.fmean(tail), statistics.stdev(tail) / math.sqrt(len(tail))


def step_over_phases(sync: dict, asynchronous: dict) -> float:
    """The asynchronous step ÷ max(G, T) of the synchronous run beside it (same seed, run just before
    on the same cores): G = the synchronous trainer's wait for rollouts, T = the rest of its step.
    1.0 is perfect overlap; the host's speed drifts by several % between runs, so pairs, not means."""
    generate = sync["timeperf/wait_rollout_mean"]
    return asynchronous["timeperf/step_mean"] / max(generate, sync["timeperf/step_mean"] - generate)


def paired_difference(syncs: list[float], asyncs: list[float]) -> tuple[float, float | None]:
    """Mean over seeds of (asynchronous − synchronous) tail reward, given each seed's tail means, and
    its standard error from the seeds' spread (None with one seed). Unlike the within-run errors it
    carries how much one seed's run varies between identical runs (seed 1's tail reward moved by up to
    0.036 in either mode, measured)."""
    differences = [a - s for s, a in zip(syncs, asyncs, strict=True)]
    if len(differences) < 2:
        return differences[0], None
    return statistics.fmean(differences), statistics.stdev(differences) / math.sqrt(len(differences))


def combined_tail_stats(runs: list[list[float]]) -> tuple[float, float]:
    """Mean over runs of their tail means, and its standard error (independent runs)."""
    stats = [tail_stats(rewards) for rewards in runs]
    return statistics.fmean(m for m, _ in stats), math.sqrt(sum(se**2 for _, se in stats)) / len(stats)


def run(manifest: Path, sets: list[str], staleness: int, steps: int, seed: int) -> dict:
    """One run: SETTINGS, then the user's ``--set`` pairs (later ones win), then η and the seed."""
    overrides = [f"{k}={v}" for k, v in SETTINGS.items()] + sets
    overrides += [f"rollout.maxStaleness={staleness}", f"seed={seed}"]
    print(f"==> η = {staleness}, seed {seed}: {steps} steps", file=sys.stderr, flush=True)
    summary = run_local(manifest, overrides, steps, None, quiet=True)
    print(f"    {summary['wall_seconds']:.1f} s, step {summary['timeperf/step_mean'] * 1000:.0f} ms "
          f"(wait for rollout {summary['timeperf/wait_rollout_mean'] * 1000:.0f} ms, "
          f"train {summary['timeperf/train_step_mean'] * 1000:.0f} ms)", file=sys.stderr, flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples/cpu-tiny.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--staleness", type=int, default=2, help="η of the asynchronous run (≥ 1)")
    parser.add_argument("--repeats", type=int, default=1, help="seed pairs to run")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting in both runs (repeatable)")
    add_out(parser, "async_vs_sync")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be ≥ 1")
    if args.staleness < 1:
        parser.error("--staleness must be ≥ 1 (η = 0 is the synchronous baseline)")
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        print(f"warning: {cores} core(s): replica and trainer cannot be pinned apart; the speedup will be small",
              file=sys.stderr)
    try:
        apply_overrides({}, args.sets)  # a malformed --set fails now, not after the first run
    except RunError as err:
        parser.error(str(err))
    seeds = list(range(args.seed, args.seed + args.repeats))
    pairs = [(run(args.manifest, args.sets, 0, args.steps, seed),
              run(args.manifest, args.sets, args.staleness, args.steps, seed)) for seed in seeds]  # fmt: skip
    syncs, asyncs = [p[0] for p in pairs], [p[1] for p in pairs]
    reward_sync, se_sync = combined_tail_stats([s["rewards"] for s in syncs])
    reward_async, se_async = combined_tail_stats([a["rewards"] for a in asyncs])
    tails_sync = [tail_stats(s["rewards"])[0] for s in syncs]
    tails_async = [tail_stats(a["rewards"])[0] for a in asyncs]
    difference, difference_se = paired_difference(tails_sync, tails_async)
    generate = statistics.fmean(s["timeperf/wait_rollout_mean"] for s in syncs)
    train = statistics.fmean(s["timeperf/step_mean"] for s in syncs) - generate
    over_phase = [step_over_phases(s, a) for s, a in pairs]
    wall_sync, wall_async = sum(s["wall_seconds"] for s in syncs), sum(a["wall_seconds"] for a in asyncs)
    result = {
        "speedup": round(wall_sync / wall_async, 3),
        "speedup_per_seed": [round(s["wall_seconds"] / a["wall_seconds"], 3) for s, a in pairs],
        "reward_sync": round(reward_sync, 4),
        "reward_async": round(reward_async, 4),
        "reward_standard_errors": [round(se_sync, 4), round(se_async, 4)],
        "reward_not_worse": reward_async >= reward_sync - 2 * math.hypot(se_sync, se_async),
        "reward_difference_paired": [round(difference, 4), None if difference_se is None else round(difference_se, 4)],
        "reward_not_worse_paired": None if difference_se is None else difference >= -2 * difference_se,
        "reward_sync_per_seed": [round(m, 4) for m in tails_sync],
        "reward_async_per_seed": [round(m, 4) for m in tails_async],
        "wall_seconds_sync": round(wall_sync, 2),
        "wall_seconds_async": round(wall_async, 2),
        "step_seconds_sync": round(statistics.fmean(s["timeperf/step_mean"] for s in syncs), 4),
        "step_seconds_async": round(statistics.fmean(a["timeperf/step_mean"] for a in asyncs), 4),
        "sync_generate_seconds_per_step": round(generate, 4),
        "sync_train_seconds_per_step": round(train, 4),
        "async_step_over_max_phase": round(statistics.fmean(over_phase), 3),
        "async_step_over_max_phase_per_seed": [round(r, 3) for r in over_phase],
        "rollout_cpu_seconds_per_step_async": round(statistics.fmean(a["timeperf/rollout_cpu_mean"] for a in asyncs),
                                                     4),
        "max_token_staleness_trained_async": max(a["max_token_staleness_trained"] for a in asyncs),
        "settings": {**SETTINGS, "overrides": args.sets, "steps": args.steps,
                     "batchSize": syncs[0].get("batch_size"), "seeds": seeds,
                     "maxStaleness": [0, args.staleness], "cores": cores, "pinned": cores >= 2,
                     "manifest": str(args.manifest.relative_to(ROOT) if args.manifest.is_relative_to(ROOT)
                                     else args.manifest)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
