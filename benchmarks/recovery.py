"""Checkpoint size and S3 upload time for the CPU example, and how long a killed trainer takes to
be training again.

1. The example's model and optimizer (tiny Qwen2 + AdamW, one step taken) are checkpointed through
   ``kuberl.checkpoint`` to a real HTTP S3 (moto's server on loopback) ``--saves`` times; reports
   bytes and median seconds (DCP write + upload + manifest) and restore seconds.
2. ``kuberl run examples/cpu-tiny.yaml`` with a checkpoint every 10 steps; after "checkpoint step
   20" the trainer process is SIGKILLed; reports seconds from the kill to the restarted gang's
   next trained step (detect exit, restart, imports, model build, restore, first batch).

    python benchmarks/recovery.py [--saves 5]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_out, report

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "workload"), str(ROOT / "operator")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint_numbers(saves: int, tmp: Path) -> dict[str, float]:
    import boto3
    import torch.distributed as dist
    from moto.server import ThreadedMotoServer

    from kuberl.fsdp.actor import FSDPActor
    from kuberl.local.processes import free_port
    from kuberl.models.tiny import char_tokenizer, tiny_qwen2
    from kuberl.policy.algorithms import AlgorithmConfig
    from kuberl.trainer.checkpointing import Checkpointer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]).create_bucket(Bucket="bench")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        actor = FSDPActor.create(tiny_qwen2(len(char_tokenizer()), 0), AlgorithmConfig(name="grpo", group_size=4),
                             lr=2e-4, temperature=1.0)  # fmt: skip
        for group in actor.optimizer.param_groups:  # AdamW moments exist only after a step
            for p in group["params"]:
                p.grad = p.detach() * 0
        actor.optimizer.step()
        checkpointer = Checkpointer("s3://bench/cpu-tiny/", every=1, keep=2, staging=tmp / "staging", rank=0)
        seconds = []
        for step in range(1, saves + 1):
            start = time.perf_counter()
            checkpointer.maybe_save(actor, step, step, step * 128)
            seconds.append(time.perf_counter() - start)
            log(f"  checkpoint {step}: {seconds[-1]:.3f} s")
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
        keys = client.list_objects_v2(Bucket="bench", Prefix=f"cpu-tiny/step-{saves:08d}/")["Contents"]
        size = sum(k["Size"] for k in keys)
        start = time.perf_counter()
        resumed = checkpointer.resume(actor)
        restore = time.perf_counter() - start
        assert resumed is not None and resumed.step == saves
    finally:
        dist.destroy_process_group()
        server.stop()
    return {"checkpoint_bytes": size, "checkpoint_files": len(keys),
            "save_and_upload_seconds_median": round(statistics.median(seconds), 3),
            "restore_seconds": round(restore, 3)}  # fmt: skip


def restart_numbers(tmp: Path) -> dict[str, float]:
    work = tmp / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kuberl_cli", "run", str(ROOT / "examples/cpu-tiny.yaml"),
                             "--max-steps", "40", "-q", "--workdir", str(work), "--set", "checkpoint.everySteps=10"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    trainer_log = work / "trainer-0.log"
    deadline = time.monotonic() + 300
    while "checkpoint step 20" not in (trainer_log.read_text() if trainer_log.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the run ended before its second checkpoint: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    pids = [int(p.name) for p in Path("/proc").glob("[0-9]*")
            if _cmdline(p).startswith(sys.executable) and "kuberl.trainer" in _cmdline(p) and str(work) in _cmdline(p)]
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    log(f"  killed trainer {pids} after checkpoint step 20")
    resumed_step = None
    while resumed_step is None:
        lines = trainer_log.read_text().split("resumed from the checkpoint", 1)
        if len(lines) == 2:
            match = re.search(r"step (\d+)/40", lines[1])
            resumed_step = int(match.group(1)) if match else None
        if time.monotonic() - killed_at > 300:
            raise SystemExit("the trainer did not come back within 300 s")
        time.sleep(0.05)
    back = time.monotonic() - killed_at
    proc.wait(timeout=300)
    return {"restart_to_next_step_seconds": round(back, 2), "resumed_first_step": resumed_step}


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=5)
    add_out(parser, "recovery")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log("checkpointing the CPU example's model + optimizer to S3 (moto):")
        result = checkpoint_numbers(args.saves, Path(tmp))
        log("killing the trainer of a running `kuberl run`:")
        result |= restart_numbers(Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
