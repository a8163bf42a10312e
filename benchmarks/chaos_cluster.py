"""Pod deletions during a run on the API emulator: does the experiment still train every prompt once,
does an inference pod's loss stay away from the trainer gang, does the run still learn?

The whole cluster path on this machine (as ``tests/test_e2e.py``): the API emulator, the operator as
its own process, the kubelet stand-in (``e2e/kubelet.py``: pods run as processes, a deleted pod's
process tree is stopped), real kubectl, moto's S3 for the checkpoints. The example
(``examples/cpu-tiny.yaml``) with 2 inference replicas and a checkpoint every 10 steps; once it
trains, a seeded schedule deletes a pod every ``--every`` steps, cycling through:

- ``inference-pod``: one of the pool's Running pods (the operator re-creates it; the rollout client
  takes it out of rotation, and back with the newest weights);
- ``trainer-pod``: the trainer's pod (the operator restarts the gang from the newest checkpoint).

Read back from ``status``: the phase and step, the prompt ledger (``promptsTrained``,
``promptsReissued``, ``promptsSkipped``: trained + pending = handed out, skipped must be 0), the
trainer pods started (one plus one per trainer-pod deletion: an inference pod's loss must not
restart the gang), the reward kubectl showed over the first and the last 20 steps. Not here: the per-step prompt audit
(``prompts.jsonl``) exists only under ``kuberl run`` (``benchmarks/chaos.py``), so "trained twice"
is checked there.

    python benchmarks/chaos_cluster.py [--faults 10] [--every 15] [--seed 0] [--steps 200]

Needs root and ``unshare`` (the kubelet stand-in gives each pod a mount namespace). Progress on
stderr; the last stdout line is the JSON result (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import yaml
from filelock import FileLock
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import add_out, report  # noqa: E402
from e2e import scenario  # noqa: E402
from tests.harness import emulated_cluster, running_operator  # noqa: E402
from tests.test_e2e import kubectl_for, kubelet_stand_in  # noqa: E402

from kuberl.api.contract import LABEL_EXPERIMENT, LABEL_ROLE, trainer_job_name  # noqa: E402
from kuberl.local.processes import free_port  # noqa: E402

KINDS = ("inference-pod", "trainer-pod")
BUCKET, SECRET = "ckpt", "s3-credentials"
KEYS = {"AWS_ACCESS_KEY_ID": "chaos-key", "AWS_SECRET_ACCESS_KEY": "chaos-secret"}  # moto's: any will do


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chaos_manifest(path: Path, steps: int, s3_endpoint: str) -> tuple[Path, str]:
    """The example with ``steps`` steps, 2 replicas, a checkpoint every 10 steps to S3 (a replaced
    trainer pod starts with an empty /tmp), a backoff limit that the trainer-pod deletions cannot use
    up, no held-out evaluation (not what is measured here)."""
    path, name = scenario.manifest(path, steps)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        if doc.get("kind") == "RLExperiment":
            spec = doc["spec"]
            spec["inference"]["replicas"] = 2
            spec["checkpoint"] = {"uri": f"s3://{BUCKET}/chaos/", "everySteps": 10, "keep": 2}
            spec["storage"] = {"credentialsSecret": SECRET, "endpoint": s3_endpoint, "region": "us-east-1"}
            spec["trainer"]["backoffLimit"] = 100
            spec.pop("evaluation", None)
    path.write_text(yaml.safe_dump_all(docs))
    return path, name


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 on loopback with the checkpoint bucket; yields its endpoint."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


class Schedule:
    """Deletes one pod each time the step passes the next mark (every ``every`` steps from the first
    checkpoint on), cycling through ``KINDS``; records what it did."""

    def __init__(self, kubectl: Any, name: str, faults: int, every: int, seed: int):
        self.kubectl, self.name, self.faults, self.every = kubectl, name, faults, every
        self.rng, self.events, self.next_step = random.Random(seed), [], every
        self.gang_restarts = 0  # the TrainerJob's status.restarts (failed ranks), as last seen
        self.trainer_pods: set[str] = set()  # the trainer pods' UIDs seen: each one a (re)start of the gang

    def __call__(self, status: dict[str, Any]) -> None:
        job = self.kubectl("get", "trainerjob", trainer_job_name(self.name), "--ignore-not-found", "-o",
                           "jsonpath={.status.restarts}")  # fmt: skip
        self.gang_restarts = max(self.gang_restarts, int(job or 0))
        self.trainer_pods |= set(self.kubectl("get", "pods", "-l", f"{LABEL_EXPERIMENT}={self.name},{LABEL_ROLE}="
                                              "trainer", "-o", "jsonpath={.items[*].metadata.uid}").split())
        progress = status.get("progress") or {}
        step = progress.get("step") or 0
        if len(self.events) >= self.faults or step < self.next_step or not progress.get("lastCheckpoint"):
            return
        kind = KINDS[len(self.events) % len(KINDS)]
        role = kind.removesuffix("-pod")
        pods = json.loads(self.kubectl("get", "pods", "-l", f"{LABEL_EXPERIMENT}={self.name},{LABEL_ROLE}={role}",
                                       "-o", "json"))["items"]  # fmt: skip
        running = sorted(p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") == "Running"
                         and not p["metadata"].get("deletionTimestamp"))  # fmt: skip
        if not running:
            return  # the last one is still coming back: try at the next poll
        pod = self.rng.choice(running)
        self.kubectl("delete", "pod", pod, "--wait=false")
        self.events.append({"kind": kind, "pod": pod, "step": step, "time": time.time()})
        self.next_step = step + self.every
        log(f"  deleted {kind} {pod} at step {step}")


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    os.environ["KUBERL_PROGRESS_SECONDS"] = "1"  # the operator polls progress every second (as the e2e tests)
    with s3_server() as endpoint:
        return await _run_on_cluster(args, tmp, endpoint)


async def _run_on_cluster(args: argparse.Namespace, tmp: Path, endpoint: str) -> dict[str, Any]:
    async with emulated_cluster(tmp) as cluster, running_operator(cluster):
        with kubelet_stand_in(cluster, tmp):
            kubectl = kubectl_for(cluster)
            secret = tmp / "secret.yaml"
            secret.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                              "metadata": {"name": SECRET}, "stringData": KEYS}))
            await asyncio.to_thread(kubectl, "create", "--validate=false", "-f", str(secret))
            path, name = chaos_manifest(tmp / "experiment.yaml", args.steps, endpoint)
            schedule = Schedule(kubectl, name, args.faults, args.every, args.seed)
            outcome = await asyncio.to_thread(scenario.run, kubectl, path, name, args.timeout, log,
                                              schedule)  # fmt: skip
    progress = outcome.progress
    trainer_deletions = sum(e["kind"] == "trainer-pod" for e in schedule.events)
    starts = len(schedule.trainer_pods)
    rewards = [(s, r) for p, s, r in outcome.observed if p == "Running" and s is not None and r is not None]
    return {
        "faults": len(schedule.events), **{k: sum(e["kind"] == k for e in schedule.events) for k in KINDS},
        "phase": outcome.phase, "steps": progress.get("step"), "seconds": round(outcome.seconds, 1),
        "prompts_trained": progress.get("promptsTrained"), "prompts_reissued": progress.get("promptsReissued"),
        "prompts_skipped": progress.get("promptsSkipped"),
        "prompts_trained_expected": args.steps * 16,  # the example's 16 prompts a step
        "trainer_pods_started": starts, "gang_restarts_not_from_trainer_deletions": starts - 1 - trainer_deletions,
        "trainer_job_failure_restarts": schedule.gang_restarts,
        # status.progress.rewardFirst10 is the last gang's: the run's own curve is what kubectl showed
        "reward_first_20_steps": mean([r for s, r in rewards if s <= 20]),
        "reward_last_20_steps": mean([r for s, r in rewards if s > args.steps - 20]),
        "leftover_pods": outcome.leftover_pods, "events": schedule.events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--every", type=int, default=15, help="steps between two pod deletions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=1800)
    add_out(parser, "chaos_cluster")
    args = parser.parse_args()
    log(f"the example on the emulator, {args.steps} steps, a pod deleted every {args.every} steps "
        f"({args.faults} in all, seed {args.seed})")
    lock = FileLock(Path(tempfile.gettempdir()) / "kuberl-kubelet-stand-in.lock")  # one stand-in per host
    with lock, tempfile.TemporaryDirectory(prefix="kuberl-chaos-cluster-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
