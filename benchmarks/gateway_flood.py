"""Training under a flood of gateway calls: steps/s before, during and after one client floods the
gateway of ``examples/cpu-agent-gateway.yaml`` while the calculator agent's episodes train.

Each ``--modes`` entry is one run (``benchmarks/agents/flooding.py``): ``refused`` (a buggy agent
retrying a refused call in a tight loop, each call a new session) or ``abandoned`` (valid calls of
sessions never rewarded). The flooder is another client (source address 127.0.0.2) in the agent's
process; it starts ``--after`` seconds after the gateway answers and lasts ``--duration`` seconds.
Steps come from the run's TensorBoard events (their wall times), so each window's steps/s is what the
trainer achieved in it.

    python benchmarks/gateway_flood.py [--modes refused,abandoned] [--steps 400] [--after 40] [--duration 40]

The last stdout line is JSON: per mode, steps/s before/during/after, during ÷ before, the flood's calls by
HTTP status, and the gateway's counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]

from kuberl.local import run_local  # noqa: E402

MANIFEST = ROOT / "examples/cpu-agent-gateway.yaml"
AGENT = ROOT / "benchmarks/agents/flooding.py"


def step_times(tensorboard: Path) -> list[float]:
    """The wall time of each training step, from the run's busiest scalar curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times: dict[int, float] = {}
    for events in tensorboard.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()["scalars"]
        busiest = max(tags, key=lambda t: len(accumulator.Scalars(t)), default=None)
        for event in accumulator.Scalars(busiest) if busiest else []:
            times.setdefault(event.step, event.wall_time)
    return sorted(times.values())


def rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / max(end - start, 1e-9)


def run(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"kuberl-flood-{mode}-") as scratch:
        workdir, log = Path(scratch) / "run", Path(scratch) / "flood.json"
        command = ["python", str(AGENT), "--mode", mode, "--after", str(args.after), "--duration",
                   str(args.duration), "--log", str(log), "--workers", "64"]
        overrides = [f"agent.command={json.dumps(command)}", "checkpoint.everySteps=1000", f"seed={args.seed}"]
        print(f"==> {mode}: {args.steps} steps, flood at +{args.after:.0f} s for {args.duration:.0f} s",
              file=sys.stderr, flush=True)
        summary = run_local(MANIFEST, overrides, args.steps, None, workdir=workdir, quiet=True)
        flood = json.loads(log.read_text()) if log.exists() else None
        times = step_times(workdir / "tensorboard")
    if flood is None or not times:
        return {"mode": mode, "error": "the run ended before the flood did; raise --steps"}
    start, end, span = flood["start"], flood["end"], flood["end"] - flood["start"]
    before, during, after = (rate(times, start - span, start), rate(times, start, end), rate(times, end, end + span))
    result = {"mode": mode, "steps_per_second": {"before": round(before, 3), "during": round(during, 3),
                                                 "after": round(after, 3)},
              "during_over_before": round(during / before, 3) if before else None,
              "during_over_after": round(during / after, 3) if after else None,
              "flood_calls_by_status": flood["statuses"], "gateway": summary.get("gateway"),
              "steps_after_flood": sum(t >= end for t in times)}
    print(f"    {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="refused,abandoned")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--after", type=float, default=60.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = [run(mode, args) for mode in args.modes.split(",")]
    print(json.dumps({"runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
