"""examples/agents/calculator_agent.py with a tool that takes time, as real tools do (a web API, a
test suite, a sandbox): each call sleeps a log-normal time with median ``--latency-ms`` and shape
``--sigma`` (0: every call takes the median; 1.5: a long tail, p99 ≈ 33 × the median), so episode
durations spread the way agent episodes do. Used by ``benchmarks/agent_async_vs_sync.py``."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/agents/calculator_agent.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("calculator_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--sigma", type=float, default=1.5)
    args, rest = parser.parse_known_args()
    agent = load_example()
    fast = agent.calculator
    rng = random.Random(0)

    def slow(expression: str) -> str:
        time.sleep(args.latency_ms / 1000 * rng.lognormvariate(0.0, args.sigma))
        return fast(expression)

    agent.calculator = slow  # episode() looks the tool up in its module at call time
    return agent.main(rest)


if __name__ == "__main__":
    sys.exit(main())
