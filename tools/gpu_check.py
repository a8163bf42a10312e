"""``scripts/gpu-check [--dry-run]``: the CUDA path proven on one GPU in one go, on a machine with no
network (its image has torch, transformers and pytest; the rest travels as wheels, scripts/gpu-wheels).

Steps, each timed and reported in ``$OUT/gpu-check.json`` (else ``./gpu-check.json``):
1. the carried wheels: the names of ``tests_gpu/wheels.txt`` at ``constraints.txt``'s versions, for
   CPython 3.12 (or pure Python), installed with ``pip --no-index --no-deps --target``;
2. ``tests_gpu/`` (pytest): device placement and a bfloat16 step over NCCL, the torch engine's KV cache
   on the GPU and its gap to the trainer, a weight update served exactly, a LoRA adapter trained and
   served within the gap (the adapter alone as the update), Megatron-core without the
   CPU shim against the FSDP actor, routing replay's effect on a Qwen3-MoE's engine–trainer gap
   (both backends, off and on: issue 47's measure where the kernels differ);
3. a short local RL run of the main example on the GPU (trainer and one replica share it; the weights
   go over the p2p exchange's gloo group in host memory, as NCCL cannot put two ranks on one GPU):
   its reward curve, step time and tokens/s;
4. ``benchmarks/gpu_engine.py``: the torch engine's tokens/s at batch 64 on a ≈ 0.4 B in-code model,
   one trainer step's time and peak memory, a weight update's time.

``--dry-run`` (any machine, CI): checks the wheel set, imports what it can, lists the tests and the
steps, prints the size of what would travel, and exits 0 when the wheel set is right.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path(os.environ.get("KUBERL_GPU_WHEELS") or ROOT / ".gpu-wheels")  # where scripts/gpu-wheels put them
SITE = Path("/tmp/kuberl-gpu-site")
TRAVEL_LIMIT = 64 * 2**20  # what the device tool carries, in all
PYTHON_TAGS = ("cp312", "py3", "py2.py3")
STEPS = ["wheels", "tests_gpu", "local run (examples/cpu-tiny.yaml on cuda, 100 steps)", "engine benchmark"]
RUN_STEPS = 100


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """constraints.txt as {normalized name: version}."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[normalized(name)] = version.strip()
    return out


def wanted() -> list[str]:
    lines = (ROOT / "tests_gpu" / "wheels.txt").read_text().splitlines()
    return [normalized(line) for line in lines if line.strip() and not line.startswith("#")]


def pinned_wheels() -> list[str]:
    """``name==version`` of every wheel the GPU machine needs (what scripts/gpu-wheels downloads)."""
    pinned = pins()
    missing = [name for name in wanted() if name not in pinned]
    if missing:
        raise SystemExit(f"gpu-wheels: {', '.join(missing)} not pinned in constraints.txt")
    return [f"{name}=={pinned[name]}" for name in wanted()]


def wheel_problems(directory: Path) -> list[str]:
    """What is wrong with the carried wheels: missing, another version, another Python, or extra."""
    pinned, problems, found = pins(), [], {}
    for wheel in sorted(directory.glob("*.whl")):
        name, version, *_, python, _abi, _platform = wheel.stem.split("-")
        found[normalized(name)] = (version, python, wheel.name)
    for name in wanted():
        if name not in found:
            problems.append(f"{name}=={pinned.get(name, '?')}: no wheel in {directory} (run scripts/gpu-wheels on a "
                            "machine that reaches PyPI)")
            continue
        version, python, file = found[name]
        if version != pinned.get(name):
            problems.append(f"{file}: version {version}, constraints.txt pins {pinned.get(name)}")
        if not any(tag in python.split(".") for tag in PYTHON_TAGS):
            problems.append(f"{file}: built for {python}, the GPU machine's Python is 3.12 (cp312)")
    problems += [f"{file}: not in tests_gpu/wheels.txt (two versions stop the install)"
                 for name, (_, _, file) in found.items() if name not in wanted()]
    return problems


def travelling_bytes() -> int:
    """The working tree the device tool sends: tracked and untracked-not-ignored files, and the wheels."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [ROOT / name.decode() for name in listed if name]
    files += list(WHEELS.glob("*.whl"))
    return sum(f.stat().st_size for f in files if f.is_file())


def timed(results: dict[str, Any], name: str, command: list[str], timeout: float, env: dict[str, str]) -> int:
    """Run ``command``, streaming its output; record its exit code and seconds under ``name``."""
    started = time.perf_counter()
    print(f"==> {name}: {' '.join(command)}", flush=True)
    try:
        code = subprocess.run(command, cwd=ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = 124
    results[name] = {"exit_code": code, "seconds": round(time.perf_counter() - started, 1)}
    return code


def dry_run(out: Path) -> int:
    problems = wheel_problems(WHEELS)
    size = travelling_bytes()
    importable = {}
    for module in ("kuberl.api", "kuberl.fsdp.actor", "kuberl.inference.engine", "kuberl.megatron.actor",
                   "kuberl.tinker.service"):
        try:
            __import__(module)
            importable[module] = "ok"
        except Exception as err:  # a report of what imports here, not a failure of the dry run
            importable[module] = f"{type(err).__name__}: {err}"
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests_gpu"], cwd=ROOT,
                               capture_output=True, text=True)
    tests = [line for line in collected.stdout.splitlines() if "::" in line]
    summary = {"dry_run": True, "wheel_problems": problems, "travelling_mib": round(size / 2**20, 2),
               "travel_limit_mib": TRAVEL_LIMIT // 2**20, "imports": importable, "tests": tests, "steps": STEPS}
    write(out, summary)
    print(f"gpu-check --dry-run: {len(tests)} GPU tests, steps: {'; '.join(STEPS)}")
    print(f"gpu-check --dry-run: {size / 2**20:.1f} MiB would travel (limit {TRAVEL_LIMIT // 2**20} MiB)")
    for line in problems:
        print(f"gpu-check --dry-run: wheel set: {line}", file=sys.stderr)
    ok = not problems and size < TRAVEL_LIMIT and len(tests) > 0 and collected.returncode == 0
    return 0 if ok else 1


def install_wheels() -> dict[str, str]:
    """The wheels into ``SITE``; the environment every later step runs in."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(SITE), *map(str, sorted(WHEELS.glob("*.whl")))], check=True)
    path = [str(SITE), *(str(ROOT / d) for d in ("workload", "operator", "cli")), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1"}


def local_run(env: dict[str, str], work: Path) -> dict[str, Any]:
    summary = work / "summary.json"
    command = [sys.executable, "-m", "kuberl_cli", "run", "examples/cpu-tiny.yaml", "--max-steps", str(RUN_STEPS),
               "--set", "trainer.accelerator=nvidia", "--set", "inference.accelerator=nvidia", "--set",
               "evaluation=null", "-q", "--workdir", str(work / "run"), "--summary", str(summary)]
    result: dict[str, Any] = {}
    timed(result, "run", command, 180, env)
    if summary.is_file():
        done = json.loads(summary.read_text())
        keep = ("steps", "reward_first10_mean", "reward_last10_mean", "trained_tokens_per_second",
                "generated_tokens_per_second", "timeperf/step_mean", "weight_sync_seconds_mean", "behav_logp_gap_max",
                "trainer", "wall_seconds")
        result |= {k: done.get(k) for k in keep} | {"rewards": done.get("rewards")}
    return result


def write(out: Path, summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2))


def check(out: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; on a machine without one, run --dry-run", file=sys.stderr)
        return 2
    if problems := wheel_problems(WHEELS):
        print("gpu-check: the wheel set is not right:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    started = time.perf_counter()
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "python": sys.version.split()[0], "steps": {}}
    env = install_wheels()
    report = out / "gpu-report.json"
    report.unlink(missing_ok=True)
    timed(summary["steps"], "tests_gpu", [sys.executable, "-m", "pytest", "tests_gpu", "-q", "-rs", "-p",
                                          "no:cacheprovider", f"--junitxml={out / 'junit.xml'}"],
          300, env | {"KUBERL_GPU_REPORT": str(report)})
    summary["tests"] = junit_counts(out / "junit.xml")
    summary["measurements"] = json.loads(report.read_text()) if report.is_file() else {}
    write(out, summary)
    summary["local_run"] = local_run(env, Path("/tmp/kuberl-gpu-check"))
    write(out, summary)
    bench = out / "gpu-engine.json"
    timed(summary["steps"], "benchmark", [sys.executable, "benchmarks/gpu_engine.py", "--out", str(bench)], 180, env)
    summary["benchmark"] = json.loads(bench.read_text()) if bench.is_file() else None
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write(out, summary)
    print(json.dumps({k: summary[k] for k in ("device", "tests", "seconds")}))
    print(json.dumps(summary["measurements"]))
    print(json.dumps({k: v for k, v in summary["local_run"].items() if k != "rewards"}))
    print(json.dumps(summary["benchmark"]))
    failed = summary["tests"].get("failed", 1) + summary["tests"].get("errors", 0)
    return 0 if failed == 0 and summary["local_run"].get("run", {}).get("exit_code") == 0 else 1


def junit_counts(path: Path) -> dict[str, int]:
    if not path.is_file():
        return {"failed": 1, "errors": 1}
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"tests": counts["tests"], "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"]}


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check and list, run nothing (no GPU needed)")
    parser.add_argument("--pins", action="store_true", help="print the wheels to carry, name==version (gpu-wheels)")
    args = parser.parse_args()
    if args.pins:
        print("\n".join(pinned_wheels()))
        return 0
    out = Path(os.environ.get("OUT") or ".")
    return dry_run(out) if args.dry_run else check(out)


if __name__ == "__main__":
    sys.exit(main())
