"""Asynchronous vs synchronous RL for an agent whose episodes take uneven time (multi-turn, tools).

The agent is ``examples/agents/calculator_agent.py`` behind the gateway (``examples/cpu-agent-gateway.yaml``),
with a tool that sleeps a log-normal time per call (``benchmarks/agents/slow_tools.py``: median
``--latency-ms``, shape σ). Both runs train the same number of steps with the same agent capacity
(``--workers`` episodes in flight); only η differs (0: synchronous, each step waits for the slowest
episode of its batch; η ≥ 1: episodes of the next batches run while the trainer trains, and a slow
episode holds up no one). Each σ in ``--sigmas`` is one sync/async pair, so the result shows how the
spread of episode durations changes the speed-up. Final reward = mean over the last 20 % of steps.

    python benchmarks/agent_async_vs_sync.py [--steps 40] [--sigmas 0,1.5] [--latency-ms 50]
                                             [--staleness 2] [--workers 128]

Progress goes to stderr; the last stdout line is JSON: ``speedup``, ``reward_sync``, ``reward_async``
(for the last σ, the long-tailed one) and ``by_sigma``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator"), str(ROOT / "benchmarks")]

from async_vs_sync import tail_stats  # noqa: E402
from common import add_out, report  # noqa: E402

from kuberl.local import run_local  # noqa: E402

MANIFEST = ROOT / "examples/cpu-agent-gateway.yaml"
AGENT = ROOT / "benchmarks/agents/slow_tools.py"


def run(staleness: int, sigma: float, args: argparse.Namespace) -> dict:
    command = ["python", str(AGENT), "--latency-ms", str(args.latency_ms), "--sigma", str(sigma),
               "--workers", str(args.workers)]
    overrides = [f"agent.command={json.dumps(command)}", f"rollout.maxStaleness={staleness}",
                 "checkpoint.everySteps=100", f"seed={args.seed}"]
    print(f"==> σ = {sigma}, η = {staleness}: {args.steps} steps", file=sys.stderr, flush=True)
    summary = run_local(MANIFEST, overrides, args.steps, None, quiet=True)
    print(f"    {summary['wall_seconds']:.1f} s, step {summary['timeperf/step_mean'] * 1000:.0f} ms (wait for "
          f"rollout {summary['timeperf/wait_rollout_mean'] * 1000:.0f} ms), reward tail "
          f"{tail_stats(summary['rewards'])[0]:.3f}", file=sys.stderr, flush=True)
    return summary


def pair(sigma: float, args: argparse.Namespace) -> dict:
    sync, asyn = run(0, sigma, args), run(args.staleness, sigma, args)
    return {
        "sigma": sigma,
        "speedup": round(sync["wall_seconds"] / asyn["wall_seconds"], 3),
        "reward_sync": round(tail_stats(sync["rewards"])[0], 4),
        "reward_async": round(tail_stats(asyn["rewards"])[0], 4),
        "wall_seconds": [sync["wall_seconds"], asyn["wall_seconds"]],
        "wait_rollout_seconds_per_step": [round(sync["timeperf/wait_rollout_mean"], 4),
                                          round(asyn["timeperf/wait_rollout_mean"], 4)],
        "max_token_staleness_trained": [sync["max_token_staleness_trained"], asyn["max_token_staleness_trained"]],
        "gateway": [sync["gateway"], asyn["gateway"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sigmas", default="0,1.5", help="log-normal shapes of the tool's latency, comma-separated")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the tool's median latency")
    parser.add_argument("--staleness", type=int, default=2, help="η of the asynchronous run (≥ 1)")
    parser.add_argument("--workers", type=int, default=128, help="the agent's episodes in flight")
    parser.add_argument("--seed", type=int, default=0)
    add_out(parser, "agent_async_vs_sync")
    args = parser.parse_args()
    if args.staleness < 1:
        parser.error("--staleness must be ≥ 1 (η = 0 is the synchronous baseline)")
    sigmas = [float(s) for s in args.sigmas.split(",")]
    by_sigma = [pair(sigma, args) for sigma in sigmas]
    headline = by_sigma[-1]
    result = {"speedup": headline["speedup"], "reward_sync": headline["reward_sync"],
              "reward_async": headline["reward_async"], "by_sigma": by_sigma,
              "settings": {"steps": args.steps, "latency_ms": args.latency_ms, "staleness": args.staleness,
                           "workers": args.workers, "seed": args.seed, "manifest": str(MANIFEST.relative_to(ROOT))}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
