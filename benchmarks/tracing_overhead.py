"""What tracing costs a run: the main example with ``spec.observability`` at the default sample rate (its
spans written to the work dir's ``traces.jsonl``, as ``kuberl run`` does) against the same run without it,
seed by seed, the two alternating so that a host's slow minutes fall on both.

Per run: the trainer's mean step seconds, the rollout process's CPU seconds per step (where most spans are
made) and, traced, how many spans were written. The result: each side's median over the seeds and their
ratio (traced ÷ untraced; the target is ≤ 1.02 for the step).

    python benchmarks/tracing_overhead.py [--steps 100] [--seeds 0 1 2] [--rate 0.05] [--out FILE]

Progress goes to stderr; the last stdout line is the JSON result (also written to
``benchmarks/results/tracing_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, add_out, report

EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"


def run(seed: int, rate: float | None, steps: int, workdir: Path) -> dict[str, Any]:
    """One ``kuberl run`` of the example at ``seed``, traced at ``rate`` (None: not traced); its numbers."""
    summary_path = workdir / "summary.json"
    traced = [] if rate is None else ["--set", f"observability.traceSampleRate={rate}"]
    command = [sys.executable, "-m", "kuberl_cli", "run", str(EXAMPLE), "-q", "--max-steps", str(steps),
               "--workdir", str(workdir), "--summary", str(summary_path), "--set", f"seed={seed}",
               "--set", "evaluation=null", *traced]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: kuberl run exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(summary_path.read_text())
    trace_file = workdir / "traces.jsonl"
    return {"step_seconds": summary["timeperf/step_mean"], "rollout_cpu_per_step": summary["timeperf/rollout_cpu_mean"],
            "spans": len(trace_file.read_text().splitlines()) if trace_file.exists() else 0}


def side(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in ("step_seconds", "rollout_cpu_per_step", "spans")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rate", type=float, default=0.05, help="observability.traceSampleRate (its default)")
    add_out(parser, "tracing_overhead")
    args = parser.parse_args()
    plain: list[dict[str, Any]] = []
    traced: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for rate, into in ((None, plain), (args.rate, traced)):
                into.append(run(seed, rate, args.steps, Path(tmp) / f"s{seed}-{'traced' if rate else 'plain'}"))
                print(f"seed {seed} {'traced' if rate else 'plain'}: {into[-1]}", file=sys.stderr)
    untraced, with_tracing = side(plain), side(traced)
    report({"steps": args.steps, "seeds": args.seeds, "rate": args.rate, "untraced": untraced,
            "traced": with_tracing, "runs": {"untraced": plain, "traced": traced},
            "step_ratio": round(with_tracing["step_seconds"] / untraced["step_seconds"], 4),
            "rollout_cpu_ratio": round(with_tracing["rollout_cpu_per_step"] / untraced["rollout_cpu_per_step"], 4)},
           args.out)


if __name__ == "__main__":
    main()
