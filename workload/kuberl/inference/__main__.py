"""``python -m kuberl.inference --config experiment.yaml [--port 8000]``: serve one replica."""

from __future__ import annotations

import argparse
import logging
import os

import torch
from aiohttp import web

from ..runconfig import load_run_config
from .server import build_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.inference")
    parser.add_argument("--config", required=True, help="run config (the operator's ConfigMap, or kuberl run's)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("KUBERL_PORT", "8000")))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inference %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get("KUBERL_THREADS", "1")))
    run = load_run_config(args.config)
    engine_name = run.spec.inference.engine or "torch"
    if engine_name != "torch":
        from .vllm_engine import serve_vllm

        serve_vllm(run, args.host, args.port)
        return
    from ..models.loading import load_model
    from .engine import TorchEngine

    model, tokenizer = load_model(run.spec.model, run.spec.seed)
    replica = int(os.environ.get("KUBERL_REPLICA", "0"))
    engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=run.spec.seed + 1000 * replica)
    web.run_app(build_app(engine, tokenizer), host=args.host, port=args.port, print=None,
                handle_signals=True)


if __name__ == "__main__":
    main()
