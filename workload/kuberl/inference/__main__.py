"""``python -m kuberl.inference --config experiment.yaml [--port 8000]``: serve one replica."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from aiohttp import web

from .. import tracing
from ..api.spec import Engine, WeightSyncMode
from ..auth import MissingToken, checked_token
from ..devices import set_compute_threads
from ..interpreter import freeze_set_up_heap
from ..runconfig import RunConfig, load_run_config
from ..settings import Settings, from_environment
from ..weights.sync import disk_directory
from .faults import injected_faults
from .server import build_app

log = logging.getLogger("kuberl.inference")
SHUTDOWN_SECONDS = 2.0  # on SIGTERM, requests in flight get this long (the rollout client resumes them elsewhere)


def served_model(run: RunConfig, settings: Settings) -> tuple[Any, Any]:
    """The model this replica serves (with the trainer's LoRA adapter, if any; split over the replica's
    processes when it spans hosts), placed on its device, and its tokenizer."""
    from ..devices import accelerator_device, compute_dtype, placed
    from ..models.loading import load_model

    spec = run.spec
    model, tokenizer = load_model(spec.model, spec.seed, settings)
    if spec.trainer.lora is not None:  # the trainer's adapter arrives with the first weights
        from ..models.lora import AdapterError, add_adapter

        try:
            add_adapter(model, spec.trainer.lora)
        except AdapterError as err:
            raise SystemExit(f"invalid spec: {err}") from err
    device = accelerator_device(spec.inference.accelerator, 0)
    return placed(model, device, compute_dtype(spec.model.dtype, spec.inference.accelerator)), tokenizer


def replica_group(settings: Settings, model: Any) -> Any:
    """This process's place in a replica over several hosts (``kuberl.inference.tensor_parallel``): the
    group joined at the leader and ``model`` split over it."""
    from .tensor_parallel import ReplicaGroup, shard_model

    log.info("replica %d: rank %d of %d, meeting at %s", settings.replica, settings.replica_host,
             settings.replica_hosts, settings.replica_leader)
    group = ReplicaGroup.join(settings.replica_leader, settings.replica_host, settings.replica_hosts,
                              model.device.type)
    shard_model(model, group.mesh)
    return group


def torch_engine_for(run: RunConfig, settings: Settings) -> tuple[Any, Any]:
    from .engine import TorchEngine
    from .tensor_parallel import TensorParallelRunner

    model, tokenizer = served_model(run, settings)
    runner = None
    if settings.replica_hosts > 1:
        runner = TensorParallelRunner(model, tokenizer.pad_token_id, replica_group(settings, model))
    engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id,
                         seed=run.spec.seed + 1000 * settings.replica, runner=runner)
    return engine, tokenizer


def follow_leader(run: RunConfig, settings: Settings) -> None:
    """A replica's rank > 0: no server; run the leader's steps over this process's shard until it stops."""
    from .step_runner import StepRunner
    from .tensor_parallel import follow

    model, tokenizer = served_model(run, settings)
    follow(StepRunner(model.eval(), tokenizer.pad_token_id), replica_group(settings, model))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.inference")
    parser.add_argument("--config", required=True, help="run config (the operator's ConfigMap, or kuberl run's)")
    parser.add_argument("--host", help="address to bind (default: the pod's IP, $POD_IP, else every address)")
    parser.add_argument("--port", type=int, help="HTTP port (default: $KUBERL_PORT, else 8000)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inference %(levelname)s %(message)s")
    run = load_run_config(args.config)
    try:
        settings = from_environment(run.settings)
        token = checked_token(settings.api_token)
        injected_faults(settings.fault_injection)  # an unknown mode is refused before anything starts
    except (MissingToken, ValueError) as err:
        raise SystemExit(str(err)) from err
    set_compute_threads(settings.threads)
    if settings.replica_host > 0:
        follow_leader(run, settings)
        return
    host, port = args.host or settings.bind_host or "0.0.0.0", args.port or settings.inference_port
    sync = run.spec.weight_sync
    weights_dir = disk_directory(sync.directory, settings) if sync.mode == WeightSyncMode.DISK else None
    engine_for = torch_engine_for
    if run.inference.engine == Engine.VLLM:
        from .vllm_engine import require_vllm, vllm_engine_for

        require_vllm()  # fail before binding the port
        engine_for = vllm_engine_for

    tracing.set_up(run.spec.observability, settings, "kuberl-inference")

    async def make_app() -> web.Application:
        engine, tokenizer = engine_for(run, settings)  # on the server's loop: vLLM's engine core starts on it
        app = build_app(engine, tokenizer, token, weights_dir, settings)
        freeze_set_up_heap()
        return app

    web.run_app(make_app(), host=host, port=port, print=None, handle_signals=True, shutdown_timeout=SHUTDOWN_SECONDS)


if __name__ == "__main__":
    main()
