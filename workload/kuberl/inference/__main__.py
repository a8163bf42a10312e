"""``python -m kuberl.inference --config experiment.yaml [--port 8000]``: serve one replica."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from aiohttp import web

from ..api.contract import ENV_PORT, ENV_REPLICA, ENV_THREADS
from ..auth import MissingToken, api_token
from ..runconfig import load_run_config
from ..weights import disk_directory
from .server import build_app

SHUTDOWN_SECONDS = 2.0  # on SIGTERM, requests in flight get this long (the rollout client resumes them elsewhere)


def torch_engine_for(run: Any, replica: int) -> tuple[Any, Any]:
    from ..devices import accelerator_device, compute_dtype
    from ..models.loading import load_model
    from .engine import TorchEngine

    spec = run.spec
    model, tokenizer = load_model(spec.model, spec.seed)
    device = accelerator_device(spec.inference.accelerator, 0)
    model = model.to(device=device, dtype=compute_dtype(spec.model.dtype, spec.inference.accelerator))
    engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=spec.seed + 1000 * replica)
    return engine, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.inference")
    parser.add_argument("--config", required=True, help="run config (the operator's ConfigMap, or kuberl run's)")
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "0.0.0.0",
                        help="address to bind (default: the pod's IP, $POD_IP)")
    parser.add_argument("--port", type=int, default=int(os.environ.get(ENV_PORT, "8000")))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inference %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get(ENV_THREADS, "1")))
    try:
        token = api_token()
    except MissingToken as err:
        raise SystemExit(str(err)) from err
    run = load_run_config(args.config)
    replica = int(os.environ.get(ENV_REPLICA, "0"))
    sync = run.spec.weight_sync
    weights_dir = disk_directory(sync.directory) if str(sync.mode) == "disk" else None
    if str(run.inference.engine) == "vllm":
        from .vllm_engine import require_vllm, vllm_engine_for

        require_vllm()  # fail before binding the port

        async def make_app() -> web.Application:
            engine, tokenizer = vllm_engine_for(run, replica)  # starts vLLM's engine core in the loop
            return build_app(engine, tokenizer, token, weights_dir)

        web.run_app(make_app(), host=args.host, port=args.port, print=None, handle_signals=True,
                    shutdown_timeout=SHUTDOWN_SECONDS)
        return
    engine, tokenizer = torch_engine_for(run, replica)
    web.run_app(build_app(engine, tokenizer, token, weights_dir), host=args.host, port=args.port, print=None,
                handle_signals=True, shutdown_timeout=SHUTDOWN_SECONDS)


if __name__ == "__main__":
    main()
