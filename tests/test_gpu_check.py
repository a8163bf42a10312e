"""scripts/gpu-check --dry-run, as CI runs it so the GPU check cannot rot: the wheel set it would
carry (fetched from PyPI by scripts/gpu-wheels) is the pinned one for CPython 3.12, the GPU tests are
collected, and what would travel to the GPU machine fits its 64 MiB."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT


def dry_run(wheels: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBERL_GPU_WHEELS": str(wheels), "OUT": str(out)}
    return subprocess.run([str(ROOT / "scripts/gpu-check"), "--dry-run"], env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_gpu_check_dry_run_accepts_the_pinned_wheels_and_refuses_others(tmp_path: Path):
    wheels = tmp_path / "wheels"
    fetched = subprocess.run([str(ROOT / "scripts/gpu-wheels")], env={**os.environ, "KUBERL_GPU_WHEELS": str(wheels)},
                             capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    done = dry_run(wheels, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["wheel_problems"] == [] and 0 < summary["travelling_mib"] < 64
    written = sum(f.read_text().count("\ndef test_") for f in (ROOT / "tests_gpu").glob("test_*.py"))
    assert len(summary["tests"]) == written and all(v == "ok" for v in summary["imports"].values())
    assert "MiB would travel" in done.stdout

    [pydantic] = wheels.glob("pydantic-2*.whl")
    shutil.move(pydantic, wheels / pydantic.name.replace("pydantic-2", "pydantic-1"))  # another version
    [core] = wheels.glob("pydantic_core-*.whl")
    shutil.move(core, wheels / core.name.replace("cp312", "cp311"))  # another Python
    problems = " ".join(gpu_check().wheel_problems(wheels))  # what the dry run prints, before it exits 1
    assert "constraints.txt pins 2." in problems and "built for cp311" in problems, problems


def gpu_check():
    """tools/gpu_check.py as a module (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
