"""Long-tailed episodes: what late episodes do to which episodes are trained, asynchronous (trained late
or dropped) against synchronous.

The main example with ``benchmarks/workflows/long_tail_episodes.py`` as its workflow (each episode ends with
a "tool" whose latency is log-normal, σ = 1.5, and whose loss-masked output grows with it), run at
η = 2 with ``rollout.lateGroups: train`` (the default: a group staler than η is trained with its importance
weights) and ``drop`` (it is discarded and its prompt re-issued), and at η = 0 (synchronous). Per run: steps
per RL second, groups dropped as too stale and trained late, the output-length distributions generated /
trained / dropped (``kuberl.rollout.lengths``) and the KS distance between generated and trained — 0 when
training sees what rollout makes, larger when the long episodes are the ones discarded — and the reward.

    python benchmarks/long_tail.py [--steps 150] [--sigma 1.5] [--median 0.05] [--out FILE]

Progress goes to stderr; the last stdout line is the JSON result (also written to
``benchmarks/results/long_tail.json``): ``{"runs": {"async": {...}, "async_drop": {...}, "sync": {...}},
"throughput_vs_drop", "throughput_vs_sync", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, add_out, report

EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"
WORKFLOWS = ROOT / "benchmarks" / "workflows"


def run(staleness: int, late: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One ``kuberl run`` of the example with the long-tailed workflow at η = ``staleness``, late groups
    ``late`` (train | drop) and ``args.set``; its numbers."""
    summary_path = workdir / "summary.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKFLOWS), os.environ.get("PYTHONPATH", "")]),
           "LONG_TAIL_SIGMA": str(args.sigma), "LONG_TAIL_MEDIAN_SECONDS": str(args.median)}
    command = [sys.executable, "-m", "kuberl_cli", "run", str(EXAMPLE), "-q", "--max-steps", str(args.steps),
               "--workdir", str(workdir), "--summary", str(summary_path),
               "--set", "rollout.workflow=long_tail_episodes:LongTailEpisodes",
               "--set", f"rollout.maxStaleness={staleness}", "--set", f"rollout.lateGroups={late}",
               "--set", "evaluation=null", *(f"--set={setting}" for setting in args.set)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"η = {staleness}: kuberl run exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(summary_path.read_text())
    lengths = summary["episode_lengths"]
    return {"max_staleness": staleness, "late_groups": late,
            "steps_per_second": round(summary["steps"] / summary["wall_seconds"], 3),
            "rl_seconds": summary["wall_seconds"],
            "trained_tokens_per_second": summary["trained_tokens_per_second"],
            "train_step_seconds_mean": summary["timeperf/train_step_mean"],
            "rollout_wait_seconds_mean": summary["timeperf/wait_rollout_mean"],
            "stale_groups_dropped": summary["stale_groups_dropped"],
            "late_groups_trained": summary["late_groups_trained"],
            "ks_generated_trained": lengths["ks_generated_trained"], "generated": lengths["generated"],
            "trained": lengths["trained"], "dropped": lengths["dropped"],
            "reward_first10_mean": summary["reward_first10_mean"], "reward_last10_mean": summary["reward_last10_mean"],
            "max_token_staleness_trained": summary["max_token_staleness_trained"]}


def ratio(runs: dict[str, dict[str, Any]], other: str, key: str) -> float | None:
    """``runs["async"][key] ÷ runs[other][key]``; None when either run was left out."""
    if "async" not in runs or other not in runs:
        return None
    return round(runs["async"][key] / runs[other][key], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (default: %(default)s)")
    parser.add_argument("--sigma", type=float, default=1.5, help="σ of the tool latency's log (default: %(default)s)")
    parser.add_argument("--median", type=float, default=0.05, help="median tool latency, s (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="another spec setting for every run, e.g. trainer.packing=true")
    parser.add_argument("--runs", nargs="+", choices=("async", "async_drop", "sync"),
                        default=["async", "async_drop", "sync"], help="which runs (default: all three)")
    add_out(parser, "long_tail")
    args = parser.parse_args()
    runs = {}
    for name, staleness, late in (("async", 2, "train"), ("async_drop", 2, "drop"), ("sync", 0, "train")):
        if name not in args.runs:
            continue
        with tempfile.TemporaryDirectory(prefix=f"kuberl-long-tail-{name}-") as tmp:
            runs[name] = run(staleness, late, args, Path(tmp))
        print(f"{name}: {runs[name]}", file=sys.stderr, flush=True)
    report({"runs": runs, "throughput_vs_drop": ratio(runs, "async_drop", "steps_per_second"),
            "throughput_vs_sync": ratio(runs, "sync", "steps_per_second"),
            "trained_tokens_per_second_vs_drop": ratio(runs, "async_drop", "trained_tokens_per_second"),
            "steps": args.steps, "settings": args.set, "sigma": args.sigma, "median_seconds": args.median,
            "example": "examples/cpu-tiny.yaml"}, args.out)


if __name__ == "__main__":
    main()
