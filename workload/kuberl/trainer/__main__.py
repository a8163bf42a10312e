"""``python -m kuberl.trainer --config experiment.yaml`` (under torchrun, or alone as one rank):
join the gang, find the inference pool, run the loop (:mod:`.loop`), leave the summary."""

from __future__ import annotations

import argparse
import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..api.contract import (
    ENV_INFERENCE_SERVICE,
    ENV_INFERENCE_URLS,
    ENV_SUMMARY_PATH,
    ENV_THREADS,
)
from ..api.spec import Accelerator
from ..auth import MissingToken, api_token
from ..collectives import exit_without_teardown
from ..devices import DIST_BACKENDS, accelerator_device
from ..runconfig import RunConfig, load_run_config
from .loop import train
from .watchdog import collective_timeout_env

log = logging.getLogger("kuberl.trainer")


def init_distributed(accelerator: str, timeout_seconds: int) -> tuple[int, int, torch.device]:
    """torchrun's env if present, else a world of one. This rank's device first (``LOCAL_RANK`` of
    the pod's accelerators), then the process group: gloo on CPU, NCCL / HCCL on accelerators
    (``kuberl.devices.DIST_BACKENDS``), whose collectives give up after ``timeout_seconds``."""
    os.environ.update(collective_timeout_env(timeout_seconds))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device = accelerator_device(accelerator, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(DIST_BACKENDS[Accelerator(accelerator)], timeout=timedelta(seconds=timeout_seconds))
    return dist.get_rank(), dist.get_world_size(), device


def inference_urls(run: RunConfig) -> list[str]:
    """Replica URLs: $KUBERL_INFERENCE_URLS (local mode), else the pool's headless-Service DNS names."""
    if os.environ.get(ENV_INFERENCE_URLS):
        return os.environ[ENV_INFERENCE_URLS].split(",")
    try:
        plan = run.inference
    except ValueError as err:
        raise SystemExit(f"invalid spec: {err}") from err
    pool = os.environ.get(ENV_INFERENCE_SERVICE, f"{run.experiment}-inference")
    port = run.spec.inference.port
    return [f"http://{pool}-r{r}-h0.{pool}:{port}" for r in range(plan.replicas)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.trainer")
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get(ENV_THREADS, "1")))
    try:
        api_token()  # checked before joining the gang: every rank fails alike, with one clear line
    except MissingToken as err:
        raise SystemExit(str(err)) from err
    run = load_run_config(args.config)
    rank, world, device = init_distributed(run.spec.trainer.accelerator, run.spec.trainer.step_timeout_seconds)
    try:
        summary = train(run, rank, world, device, inference_urls(run) if rank == 0 else [])
        if summary is not None and os.environ.get(ENV_SUMMARY_PATH):
            Path(os.environ[ENV_SUMMARY_PATH]).write_text(json.dumps(summary, indent=2))
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
