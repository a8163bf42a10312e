"""Long-tailed episodes, asynchronous against synchronous: what staleness by discarding does to which
episodes are trained.

The main example with ``benchmarks/workflows/long_tail_episodes.py`` as its workflow (each episode ends with
a "tool" whose latency is log-normal, σ = 1.5, and whose loss-masked output grows with it), run at
η = 2 (asynchronous) and η = 0 (synchronous). Per run: steps per RL second, groups dropped as too stale,
the output-length distributions generated / trained / dropped (``kuberl.rollout.lengths``) and the KS
distance between generated and trained — 0 when training sees what rollout makes, larger when the long
episodes are the ones discarded — and the reward.

    python benchmarks/long_tail.py [--steps 150] [--sigma 1.5] [--median 0.05] [--out FILE]

Progress goes to stderr; the last stdout line is the JSON result (also written to
``benchmarks/results/long_tail.json``): ``{"runs": {"async": {...}, "sync": {...}}, "throughput_ratio", ...}``.
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


def run(staleness: int, steps: int, sigma: float, median: float, workdir: Path) -> dict[str, Any]:
    """One ``kuberl run`` of the example with the long-tailed workflow at η = ``staleness``; its numbers."""
    summary_path = workdir / "summary.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKFLOWS), os.environ.get("PYTHONPATH", "")]),
           "LONG_TAIL_SIGMA": str(sigma), "LONG_TAIL_MEDIAN_SECONDS": str(median)}
    command = [sys.executable, "-m", "kuberl_cli", "run", str(EXAMPLE), "-q", "--max-steps", str(steps),
               "--workdir", str(workdir), "--summary", str(summary_path),
               "--set", "rollout.workflow=long_tail_episodes:LongTailEpisodes",
               "--set", f"rollout.maxStaleness={staleness}", "--set", "evaluation=null"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"η = {staleness}: kuberl run exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(summary_path.read_text())
    lengths = summary["episode_lengths"]
    return {"max_staleness": staleness, "steps_per_second": round(summary["steps"] / summary["wall_seconds"], 3),
            "rl_seconds": summary["wall_seconds"], "stale_groups_dropped": summary["stale_groups_dropped"],
            "ks_generated_trained": lengths["ks_generated_trained"], "generated": lengths["generated"],
            "trained": lengths["trained"], "dropped": lengths["dropped"],
            "reward_first10_mean": summary["reward_first10_mean"], "reward_last10_mean": summary["reward_last10_mean"],
            "max_token_staleness_trained": summary["max_token_staleness_trained"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (default: %(default)s)")
    parser.add_argument("--sigma", type=float, default=1.5, help="σ of the tool latency's log (default: %(default)s)")
    parser.add_argument("--median", type=float, default=0.05, help="median tool latency, s (default: %(default)s)")
    add_out(parser, "long_tail")
    args = parser.parse_args()
    runs = {}
    for name, staleness in (("async", 2), ("sync", 0)):
        with tempfile.TemporaryDirectory(prefix=f"kuberl-long-tail-{name}-") as tmp:
            runs[name] = run(staleness, args.steps, args.sigma, args.median, Path(tmp))
        print(f"{name}: {runs[name]}", file=sys.stderr, flush=True)
    report({"runs": runs, "throughput_ratio": round(runs["async"]["steps_per_second"] /
                                                   runs["sync"]["steps_per_second"], 3),
            "steps": args.steps, "sigma": args.sigma, "median_seconds": args.median,
            "example": "examples/cpu-tiny.yaml"}, args.out)


if __name__ == "__main__":
    main()
