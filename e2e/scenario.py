"""The end-to-end scenario, driven only through the real ``kubectl``: apply the CPU example, watch
``kubectl get rlexperiments`` until it succeeds, check the status, delete, check nothing is left.

Runs against whatever the kubeconfig points to. On a real cluster with the operator installed
(``helm install kuberl charts/kuberl --set watchNamespaces={default}``, or the namespace given
below) and the workload image pullable:

    python -m e2e.scenario --kubeconfig ~/.kube/config [--namespace default] [--steps 100]

In CI, ``tests/test_e2e.py`` runs it against the API emulator, the real operator and the
kubelet stand-in (``e2e/kubelet.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/cpu-tiny.yaml"
Kubectl = Callable[..., str]


@dataclass
class Outcome:
    phase: str
    progress: dict[str, object]
    observed: list[tuple[str, object, object]] = field(default_factory=list)  # (phase, step, reward) changes
    tables: list[str] = field(default_factory=list)
    yaml: str = ""
    seconds: float = 0.0
    leftover_pods: list[str] = field(default_factory=list)


def manifest(path: Path, steps: int, example: Path = EXAMPLE,
             algorithm: dict[str, object] | None = None, sft_steps: int | None = None) -> tuple[Path, str]:
    """``example`` (the CPU example) with ``steps`` training steps (and other ``algorithm`` fields,
    ``sft_steps`` warm-up steps when given), written to ``path``; returns it and the experiment's name."""
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    for doc in docs:
        if doc.get("kind") == "RLExperiment":
            doc["spec"]["algorithm"] |= {**(algorithm or {}), "maxSteps": steps}
            if sft_steps is not None:
                doc["spec"]["model"]["sftWarmup"]["steps"] = sft_steps
            name = doc["metadata"]["name"]
    path.write_text(yaml.safe_dump_all(docs))
    return path, name


def run(kubectl: Kubectl, path: Path, name: str, timeout: float = 600, say: Callable[[str], None] = print,
        on_status: Callable[[dict[str, object]], None] | None = None) -> Outcome:
    """Apply, watch until Succeeded or Failed (``on_status`` sees every polled status: a scenario
    can act mid-run, e.g. delete a pod), then delete and wait until no pod is left."""
    start = time.monotonic()
    say(kubectl("apply", "--validate=false", "-f", str(path)).strip())
    outcome = Outcome(phase="", progress={})
    while time.monotonic() - start < timeout:
        obj = json.loads(kubectl("get", "rlexperiment", name, "-o", "json"))
        status = obj.get("status") or {}
        outcome.phase, outcome.progress = status.get("phase", ""), status.get("progress") or {}
        if on_status is not None:
            on_status(status)
        seen = (outcome.phase, outcome.progress.get("step"), outcome.progress.get("reward"))
        if not outcome.observed or outcome.observed[-1] != seen:
            outcome.observed.append(seen)
            table = kubectl("get", "rlexperiments")
            outcome.tables.append(table)
            say(table.rstrip())
        if outcome.phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    outcome.seconds = time.monotonic() - start
    outcome.yaml = kubectl("get", "rlx", name, "-o", "yaml")
    say(kubectl("delete", "-f", str(path), "--wait=true").strip())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        outcome.leftover_pods = kubectl("get", "pods", "-l", f"kuberl.io/experiment={name}", "-o", "name").split()
        if not outcome.leftover_pods:
            break
        time.sleep(1)
    return outcome


def problems(outcome: Outcome, steps: int, learning: bool = True) -> list[str]:
    """What a user would call broken about this run (empty: the whole path works). ``learning``:
    also that the reward rose and the held-out evaluation reached ``kubectl get``."""
    out = []
    if outcome.phase != "Succeeded":
        out.append(f"phase {outcome.phase!r}, not Succeeded")
    if outcome.progress.get("step") != steps:
        out.append(f"status.progress.step is {outcome.progress.get('step')}, expected {steps}")
    running_steps = {s for p, s, _ in outcome.observed if p == "Running" and s is not None}
    if len(running_steps) < 2:
        out.append(f"kubectl get never showed the step moving while Running: {outcome.observed}")
    if outcome.leftover_pods:
        out.append(f"pods left after delete: {outcome.leftover_pods}")
    return out + (learning_problems(outcome) if learning else [])


def learning_problems(outcome: Outcome) -> list[str]:
    out = []
    first, last = outcome.progress.get("rewardFirst10"), outcome.progress.get("rewardLast10")
    if not (isinstance(first, float) and isinstance(last, float) and last > first):
        out.append(f"reward did not improve: first 10 steps {first}, last 10 steps {last}")
    evaluated = outcome.progress.get("evalReward")
    if not isinstance(evaluated, float):
        out.append(f"no held-out evaluation reached status.progress.evalReward: {outcome.progress}")
    elif not outcome.tables or "EVAL" not in outcome.tables[-1] or str(evaluated) not in outcome.tables[-1]:
        out.append(f"kubectl get rlexperiments does not show EVAL {evaluated}: {outcome.tables[-1:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    def kubectl(*argv: str) -> str:
        return subprocess.run([args.kubectl, "--kubeconfig", args.kubeconfig, "-n", args.namespace, *argv],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip

    path, name = manifest(Path("/tmp/kuberl-e2e.yaml"), args.steps)
    outcome = run(kubectl, path, name)
    found = problems(outcome, args.steps)
    print(json.dumps({"phase": outcome.phase, "progress": outcome.progress, "seconds": round(outcome.seconds, 1),
                      "problems": found}))  # fmt: skip
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
