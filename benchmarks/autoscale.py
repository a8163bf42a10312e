"""The pool autoscaler on real runs: the main example with ``spec.inference.autoscale`` on, through
``kuberl run`` (whose supervisor applies the operator's rule, ``kuberl.api.autoscale.decide``).

Every replica is given a fixed capacity (``KUBERL_FAULT_INJECTION=generate-slots=N,generate-seconds=S``:
at most N ``/generate`` requests at once, each held S seconds at least), so generation is bound by
the replicas, not by this host's two cores, as it is on a cluster where each replica has its own
accelerator. Two cases:

- ``grow``: one replica, too few for the trainer — the pool should grow until the trainer's wait
  fraction is at most the target, then stay;
- ``shrink``: the maximum, more than the trainer needs — the pool should shrink while the wait stays
  under half the target.

For each: every change (step, seconds, from → to, the wait fraction that decided it), the fewest
seconds between two changes (≥ the window: no flapping), the final replica count, and the wait
fraction of the last 50 steps.

    python benchmarks/autoscale.py [--steps 500] [--window 10] [--target 0.1] [--max-replicas 4]
                                   [--slots 8 --seconds 0.1] [--out benchmarks/results/autoscale.json]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]

from common import add_out, report  # noqa: E402

from kuberl.api.contract import ENV_FAULT_INJECTION  # noqa: E402
from kuberl.local import run_local  # noqa: E402
from kuberl.local.autoscale import TRACE_FILE  # noqa: E402

STEP_LINE = re.compile(r"trainer INFO step (\d+)/\d+ .*? wait ([\d.]+)s")
TIME_OF_STEP = re.compile(r"^\S+ (\d\d):(\d\d):(\d\d),(\d{3}) trainer INFO step (\d+)/", re.M)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step_seconds(trainer_log: str) -> dict[int, float]:
    """Each step's end, in seconds of the day, from the trainer's log lines."""
    return {int(step): int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000
            for h, m, s, ms, step in TIME_OF_STEP.findall(trainer_log)}


def tail_wait_fraction(trainer_log: str, steps: int = 50) -> float:
    """Σ wait ÷ Σ step seconds over the last ``steps`` steps (the log's 10 ms wait resolution)."""
    waits = {int(s): float(w) for s, w in STEP_LINE.findall(trainer_log)}
    ends = step_seconds(trainer_log)
    last = sorted(ends)[-steps - 1:]
    span = ends[last[-1]] - ends[last[0]]
    return round(sum(waits[s] for s in last[1:]) / span, 3) if span > 0 else 0.0


def run_case(name: str, args: argparse.Namespace, replicas: int) -> dict:
    sets = [f"inference.replicas={replicas}", "inference.autoscale.minReplicas=1",
            f"inference.autoscale.maxReplicas={args.max_replicas}",
            f"inference.autoscale.targetWaitFraction={args.target}",
            f"inference.autoscale.windowSeconds={args.window}", "checkpoint.everySteps=100"]
    with tempfile.TemporaryDirectory(prefix=f"kuberl-autoscale-{name}-") as tmp:
        work = Path(tmp)
        log(f"==> {name}: {replicas} replica(s) to start, {args.steps} steps, window {args.window} s, "
            f"target wait {args.target:.0%}")
        summary = run_local(args.manifest, sets, args.steps, None, quiet=True, workdir=work)
        trace_file = work / TRACE_FILE
        changes = [json.loads(line) for line in trace_file.read_text().splitlines()] if trace_file.exists() else []
        trainer_log = (work / "trainer-0.log").read_text()
    gaps = [b["seconds"] - a["seconds"] for a, b in itertools.pairwise(changes)]
    final = changes[-1]["to"] if changes else replicas
    for c in changes:
        log(f"    step {c['step']:4d} at {c['seconds']:6.1f} s: {c['from']} → {c['to']} ({c['reason']})")
    result = {
        "start_replicas": replicas,
        "final_replicas": final,
        "changes": changes,
        "fewest_seconds_between_changes": round(min(gaps), 1) if gaps else None,
        "wait_fraction_last_50_steps": tail_wait_fraction(trainer_log),
        "reward_first10": summary["reward_first10_mean"],
        "reward_last10": summary["reward_last10_mean"],
        "prompts": summary["prompts"],
        "wall_seconds": summary["wall_seconds"],
    }
    log(f"    final {final} replica(s), wait {result['wait_fraction_last_50_steps']:.0%} of the last 50 steps")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples/cpu-tiny.yaml")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--window", type=int, default=10, help="spec.inference.autoscale.windowSeconds (≥ 10)")
    parser.add_argument("--target", type=float, default=0.1, help="targetWaitFraction")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="each replica's /generate requests at once")
    parser.add_argument("--seconds", type=float, default=0.1, help="each /generate held at least this long")
    add_out(parser, "autoscale")
    args = parser.parse_args()
    os.environ[ENV_FAULT_INJECTION] = f"generate-slots={args.slots},generate-seconds={args.seconds}"
    result = {
        "grow": run_case("grow", args, 1),
        "shrink": run_case("shrink", args, args.max_replicas),
        "settings": {"steps": args.steps, "windowSeconds": args.window, "targetWaitFraction": args.target,
                     "maxReplicas": args.max_replicas, "replica_capacity": {"slots": args.slots,
                                                                           "seconds": args.seconds},
                     "manifest": str(args.manifest.relative_to(ROOT) if args.manifest.is_relative_to(ROOT)
                                     else args.manifest)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
