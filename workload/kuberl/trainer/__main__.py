"""``python -m kuberl.trainer --config experiment.yaml`` (under torchrun, or alone as one rank).

Rank 0 also runs the asynchronous rollout (its own thread and event loop) and the progress
endpoint. Every step: take a fresh batch → advantages → decoupled PPO step on FSDP2 → gather the
new weights → push them to every inference replica (``broadcast``) → version + 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..api import resolve
from ..api.contract import (
    ENV_CHECKPOINT_URI,
    ENV_INFERENCE_SERVICE,
    ENV_INFERENCE_URLS,
    ENV_MAX_STEPS,
    ENV_PROGRESS_PORT,
    ENV_STAGING_DIR,
    ENV_SUMMARY_PATH,
    ENV_TERMINATION_LOG,
    ENV_THREADS,
    TERMINATION_LOG,
)
from ..api.spec import Accelerator
from ..auth import MissingToken, api_token
from ..collectives import broadcast_from_rank0, exit_without_teardown
from ..data.datasets import examples
from ..devices import DIST_BACKENDS, accelerator_device, compute_dtype
from ..models.loading import load_model
from ..rewards import load_reward
from ..rollout.client import InferenceClient
from ..rollout.controller import RolloutController
from ..rollout.staleness import StalenessManager
from ..rollout.workflow import RLVRWorkflow
from ..runconfig import RunConfig, load_run_config
from ..weights import make_weight_sync
from .actor import Actor
from .algorithms import AlgorithmConfig, build_batch
from .batch import collate
from .checkpointing import Checkpointer
from .loss import BehaviourGapMonitor
from .progress import Progress, ProgressServer
from .sft import encode, sft_warmup
from .watchdog import StepWatchdog, collective_timeout_env

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


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def train(run: RunConfig, rank: int, world: int, device: torch.device) -> dict[str, object] | None:
    spec = run.spec
    algo = spec.algorithm
    max_steps = int(os.environ.get(ENV_MAX_STEPS, algo.max_steps))
    torch.manual_seed(spec.seed)
    model, tokenizer = load_model(spec.model, spec.seed)
    config = AlgorithmConfig(
        name=str(algo.name), group_size=algo.group_size, clip_low=algo.clip.low, clip_high=algo.clip.high,
        dual_clip=algo.clip.dual, kl_coef=algo.kl_coef, behavior_imp_cap=algo.behavior_imp_cap,
        max_new_tokens=spec.rollout.max_new_tokens,
    )
    _, plan, _ = resolve(spec)
    if plan is not None and str(plan.backend) != "fsdp":
        raise SystemExit(f"spec.trainer.backend is {plan.backend}: this build trains with fsdp only. The Megatron-"
                         "core backend has its weight conversion and model building (kuberl.megatron) but not "
                         "its training loop, which needs CUDA/NPU devices to verify; use backend: fsdp")
    dtype = compute_dtype(spec.model.dtype, spec.trainer.accelerator)
    actor = Actor.create(model, config, algo.learning_rate, spec.rollout.temperature, algo.mini_batches, device,
                         dtype)
    checkpointer = Checkpointer(os.environ.get(ENV_CHECKPOINT_URI) or spec.checkpoint.uri,
                                spec.checkpoint.every_steps, spec.checkpoint.keep,
                                Path(os.environ.get(ENV_STAGING_DIR, "/tmp/kuberl-staging")), rank,
                                int(os.environ.get("LOCAL_RANK", "0")), run.run_id)
    resumed = checkpointer.resume(actor)
    first_step = resumed.step if resumed else 0
    sft_losses: list[float] = []
    if resumed is None:
        warm = spec.model.sft_warmup
        sft_losses = sft_warmup(actor.model, tokenizer, examples(spec.dataset, spec.seed + 7), warm.steps,
                                warm.batch_size, warm.learning_rate, rank, world)
        actor.freeze_reference()  # π_ref is the policy RL starts from (a resume restores it instead)
    elif rank == 0:
        log.info("resumed from the checkpoint of step %d (version %d)", resumed.step, resumed.version)
    groups_per_step = algo.batch_size // algo.group_size

    controller = server = None
    if rank == 0:
        reward_fn = load_reward(spec.reward.function)
        workflow = RLVRWorkflow(
            encode=lambda p: encode(tokenizer, p), decode=lambda ids: tokenizer.decode(ids),
            eos_id=tokenizer.eos_token_id, reward=reward_fn, group_size=algo.group_size,
            max_new_tokens=spec.rollout.max_new_tokens, temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
        )
        manager = StalenessManager(groups_per_step, spec.rollout.max_staleness,
                                   max(1, spec.rollout.max_concurrent // algo.group_size))
        manager.restore(first_step)  # admission restarts at version × batch: no burst of stale samples
        position = resumed.data_position if resumed else 0
        controller = RolloutController(InferenceClient(inference_urls(run), api_token()), workflow,
                                       examples(spec.dataset, spec.seed, position), manager)
        controller.episodes = position
        controller.start()
        server = ProgressServer(Progress(step=first_step, version=first_step, max_steps=max_steps, phase="running"))
        server.start_in(controller.loop, int(os.environ.get(ENV_PROGRESS_PORT, "8080")))
    sync = make_weight_sync(str(spec.weight_sync.mode), controller, rank, world, spec.weight_sync.directory)
    sync.push(actor, first_step)  # the pool gets the (resumed) weights before rollout starts
    sync.wait()
    if rank == 0:
        log.info("initial weights (version %d) pushed; SFT warm-up losses %s", first_step,
                 [round(x, 3) for x in sft_losses[::max(1, len(sft_losses) // 5)]])

    start = time.perf_counter()
    rewards: list[float] = []
    trained_tokens = 0
    timeperf: dict[str, list[float]] = {"wait_rollout": [], "train_step": [], "weight_sync": [], "weight_push": [],
                                         "step": []}
    token_staleness = 0
    dropped_groups = 0
    gaps = BehaviourGapMonitor(warn=rank == 0)
    steps_done = first_step
    watchdog = StepWatchdog(spec.trainer.step_timeout_seconds).start()
    for step in range(first_step, max_steps):
        step_start = time.perf_counter()
        while True:  # rank 0 takes a batch and shares it; if the pool is starved, all ranks re-send weights
            batch_of_rank0: object = None
            if rank == 0:
                assert controller is not None
                wait_start = time.perf_counter()
                groups = controller.take(groups_per_step, step)
                if groups is not None:
                    trajs, advs, dropped = build_batch(groups, config)
                    dropped_groups += dropped
                    batch_of_rank0 = (trajs, advs, time.perf_counter() - wait_start)
            payload = broadcast_from_rank0(batch_of_rank0)
            if payload is not None:
                break
            log.warning("step %d: every replica needs weights; re-sending version %d", step, step)
            sync.recover(actor, step)
        trajs, advs, wait_s = payload  # type: ignore[misc]
        timeperf["wait_rollout"].append(wait_s)
        token_staleness = max([token_staleness, *(step - v for t in trajs for v in t.versions)])
        if not trajs:
            log.warning("step %d: every group was filtered out (no reward variance); skipping", step)
        else:
            local = list(range(rank, len(trajs), world)) or [0]  # a rank without rows trains on a masked filler
            batch = collate([trajs[i] for i in local], [advs[i] for i in local], tokenizer.pad_token_id,
                            version=step)
            if rank >= len(trajs):
                batch = batch.masked()
            stats = actor.train_step(batch, len(trajs))
            gaps.observe(step, stats)
            timeperf["train_step"].append(stats["timeperf/train_step"])
            trained_tokens += sum(len(t.output_ids) for t in trajs)
        push_start = time.perf_counter()
        previous = sync.wait()  # the previous exchange, which overlapped this step
        if step > first_step:  # the first push of this process was waited for before the loop
            timeperf["weight_sync"].append(previous)
        sync.push(actor, step + 1)
        timeperf["weight_push"].append(time.perf_counter() - push_start)
        timeperf["step"].append(time.perf_counter() - step_start)
        steps_done = step + 1
        saved = checkpointer.maybe_save(actor, step + 1, step + 1, controller.episodes if controller else 0)
        watchdog.beat()  # the step and its checkpoint are done
        if saved and server is not None:
            server.update(last_checkpoint=saved)
        if rank == 0:
            assert controller is not None and server is not None
            reward = mean([t.reward for t in trajs]) or 0.0
            rewards.append(reward)
            elapsed = time.perf_counter() - start
            server.update(step=step + 1, version=step + 1, reward=reward, reward_first10=mean(rewards[:10]),
                          reward_last10=mean(rewards[-10:]),
                          max_staleness=controller.max_staleness_seen,
                          tokens_per_second=trained_tokens / elapsed, step_seconds=timeperf["step"][-1],
                          weight_sync_seconds=previous, behav_logp_gap=gaps.last)
            if trajs:
                gap = gaps.last if gaps.last is not None else math.nan
                log.info("step %d/%d reward %.3f staleness≤%d loss %.4f gap %.2g wait %.2fs sync %.3fs", step + 1,
                         max_steps, reward, controller.max_staleness_seen, stats["ppo_actor/loss"], gap, wait_s,
                         previous)
    timeperf["weight_sync"].append(sync.wait())
    watchdog.stop()
    wall = time.perf_counter() - start
    if rank != 0:
        return None
    assert controller is not None and server is not None
    summary = {
        "steps": steps_done,
        "resumed_from_step": first_step,
        "batch_size": algo.batch_size,
        "reward_first10_mean": mean(rewards[:10]),
        "reward_last10_mean": mean(rewards[-10:]),
        "max_staleness_observed": controller.max_staleness_seen,
        "max_token_staleness_trained": token_staleness,
        "final_version": controller.manager.version,  # what every replica confirmed it serves
        **gaps.summary(),
        "wall_seconds": round(wall, 3),
        "trained_tokens_per_second": round(trained_tokens / wall, 1),
        "generated_tokens_per_second": round(controller.generated_tokens / wall, 1),
        "weight_sync_seconds_mean": round(mean(timeperf["weight_sync"]) or 0.0, 4),
        **{f"timeperf/{k}_mean": round(mean(v) or 0.0, 4) for k, v in timeperf.items()},
        "stale_groups_dropped": controller.buffer.dropped,
        "filtered_groups": dropped_groups,
        "sft_warmup_final_loss": sft_losses[-1] if sft_losses else None,
        "max_staleness": spec.rollout.max_staleness,
        "world_size": world,
        "replicas": len(controller.client.replicas),
        "rewards": [round(r, 4) for r in rewards],
    }
    server.update(phase="succeeded")
    server.write_termination_message(Path(os.environ.get(ENV_TERMINATION_LOG, TERMINATION_LOG)))
    controller.stop()
    return summary


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
        summary = train(run, rank, world, device)
        if summary is not None and os.environ.get(ENV_SUMMARY_PATH):
            Path(os.environ[ENV_SUMMARY_PATH]).write_text(json.dumps(summary, indent=2))
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
