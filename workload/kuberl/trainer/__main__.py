"""``python -m kuberl.trainer --config experiment.yaml`` (under torchrun, or alone as one rank):
join the gang, find the inference pool, run the loop (:mod:`.loop`), leave the summary."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..api.spec import Accelerator
from ..auth import MissingToken, checked_token
from ..collectives import exit_without_teardown
from ..devices import DIST_BACKENDS, accelerator_device, set_compute_threads
from ..runconfig import load_run_config
from ..settings import Settings, from_environment
from .loop import train
from .pool import inference_urls
from .watchdog import collective_timeout_env

log = logging.getLogger("kuberl.trainer")


def init_distributed(accelerator: str, timeout_seconds: int, settings: Settings) -> tuple[int, int, torch.device]:
    """torchrun's env if present, else a world of one. This rank's device first (``LOCAL_RANK`` of
    the pod's accelerators), then the process group: gloo on CPU, NCCL / HCCL on accelerators
    (``kuberl.devices.DIST_BACKENDS``), whose collectives give up after ``timeout_seconds``."""
    os.environ.update(collective_timeout_env(timeout_seconds))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", settings.master_addr)
    os.environ.setdefault("MASTER_PORT", str(settings.master_port))
    device = accelerator_device(accelerator, settings.local_rank)
    dist.init_process_group(DIST_BACKENDS[Accelerator(accelerator)], timeout=timedelta(seconds=timeout_seconds))
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.trainer")
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    run = load_run_config(args.config)
    try:
        settings = from_environment(run.settings)
        checked_token(settings.api_token)  # before joining the gang: every rank fails alike, with one clear line
    except (MissingToken, ValueError) as err:
        raise SystemExit(str(err)) from err
    set_compute_threads(settings.threads)
    rank, world, device = init_distributed(run.spec.trainer.accelerator, run.spec.trainer.step_timeout_seconds,
                                           settings)
    try:
        summary = train(run, settings, rank, world, device, inference_urls(run, settings) if rank == 0 else [])
        if summary is not None and settings.summary_path is not None:
            settings.summary_path.write_text(json.dumps(summary, indent=2))
    except BaseException as err:  # reported here, then the rank ends at once (below)
        code = failure_exit_code(err)
    else:
        code = 0
    finally:
        dist.destroy_process_group()
    exit_without_teardown(code)


def failure_exit_code(err: BaseException) -> int:
    """Report ``err`` as the interpreter would (a ``SystemExit``'s message, else the traceback) and
    return the exit code. The rank then ends without the interpreter's shutdown, which would wait
    for worker threads: a p2p send to a replica that will never take it (the rollout process that
    tells replicas to receive is gone) holds a thread until the exchange's 300 s timeout, and the
    gang's restart with it."""
    if isinstance(err, SystemExit):
        if isinstance(err.code, int) or err.code is None:
            return err.code or 0
        print(err.code, file=sys.stderr)
        return 1
    traceback.print_exception(err)
    return 1


if __name__ == "__main__":
    main()
