"""A smaller run of ``benchmarks/fuzz.py`` (the 10,000-case run is the benchmark): mutated
manifests, YAML text, /generate bodies and progress replies; not one traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fuzzing_every_input_door_finds_no_traceback():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/fuzz.py"), "--cases", "600", "--seed", "7"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cases"] == 600 and set(result["per_target"]) == {"manifest", "yaml", "generate", "progress"}
    assert result["tracebacks"] == 0, done.stderr[-3000:]
