"""The training loop, top-down (``train``), and its named steps.

Rank 0 also runs the asynchronous rollout (its own thread and event loop) and the progress
endpoint. Every step: take a fresh batch (rank 0 shares it) → advantages → decoupled PPO step on
FSDP2 → push the new weights to every inference replica (overlapping the next step) → checkpoint
when due → report. Version v = weights after v steps.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import Progress, resolve
from ..api.contract import (
    ENV_AGENT_TOKEN,
    ENV_CHECKPOINT_URI,
    ENV_GATEWAY_PORT,
    ENV_MAX_STEPS,
    ENV_PROGRESS_PORT,
    ENV_STAGING_DIR,
    ENV_TERMINATION_LOG,
    GATEWAY_PORT,
    TERMINATION_LOG,
)
from ..auth import api_token
from ..collectives import broadcast_from_rank0
from ..data.datasets import examples
from ..devices import compute_dtype
from ..gateway.server import Gateway, GatewayConfig
from ..models.loading import load_model
from ..rewards import load_reward
from ..rollout.client import InferenceClient
from ..rollout.controller import RolloutController
from ..rollout.evaluation import EvalResult
from ..rollout.staleness import StalenessManager
from ..rollout.types import Trajectory
from ..runconfig import RunConfig
from ..weights import make_weight_sync
from .actor import Actor
from .algorithms import AlgorithmConfig, build_batch, learning_rate_at
from .batch import collate
from .checkpointing import Checkpointer, TrainerState
from .curves import Curves
from .evaluations import Evaluations
from .loss import BehaviourGapMonitor
from .progress import ProgressServer
from .sft import sft_warmup
from .watchdog import StepWatchdog
from .workflows import make_workflow

log = logging.getLogger("kuberl.trainer")
EVAL_WAIT_SECONDS = 600.0  # the last evaluation, after the last step


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class Session:
    """What every step of one run shares (``controller`` and ``server`` exist on rank 0 only)."""

    run: RunConfig
    rank: int
    world: int
    tokenizer: Any
    config: AlgorithmConfig
    actor: Actor
    checkpointer: Checkpointer
    sync: Any
    first_step: int
    max_steps: int
    sft_losses: list[float]
    controller: RolloutController | None = None
    server: ProgressServer | None = None
    gateway: Gateway | None = None
    curves: Curves | None = None
    evaluations: Evaluations | None = None

    @property
    def groups_per_step(self) -> int:
        algo = self.run.spec.algorithm
        return algo.batch_size // algo.group_size


@dataclass
class Tally:
    """What the steps add up, for the progress line, ``/progress`` and the summary."""

    gaps: BehaviourGapMonitor
    steps_done: int
    start: float = field(default_factory=time.perf_counter)
    rewards: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # ppo_actor/entropy of each step that trained
    trained_tokens: int = 0
    token_staleness: int = 0
    dropped_groups: int = 0
    tool_calls: list[float] = field(default_factory=list)  # mean tool calls per episode, per step
    timeperf: dict[str, list[float]] = field(default_factory=lambda: {
        "wait_rollout": [], "train_step": [], "weight_sync": [], "weight_push": [], "step": []})


def algorithm_config(run: RunConfig) -> AlgorithmConfig:
    spec, algo = run.spec, run.spec.algorithm
    return AlgorithmConfig(
        name=str(algo.name), group_size=algo.group_size, clip_low=algo.clip.low, clip_high=algo.clip.high,
        dual_clip=algo.clip.dual, kl_coef=algo.kl_coef, behavior_imp_cap=algo.behavior_imp_cap,
        max_new_tokens=spec.rollout.max_new_tokens,
    )


def _require_fsdp(run: RunConfig) -> None:
    _, plan, _ = resolve(run.spec)
    if plan is not None and str(plan.backend) != "fsdp":
        raise SystemExit(f"spec.trainer.backend is {plan.backend}: this build trains with fsdp only. The Megatron-"
                         "core backend has its weight conversion and model building (kuberl.megatron) but not "
                         "its training loop, which needs CUDA/NPU devices to verify; use backend: fsdp")


def _start_rollout(run: RunConfig, tokenizer: Any, first_step: int, data_position: int, max_steps: int,
                   urls: list[str]) -> tuple[RolloutController, ProgressServer, Gateway | None]:
    """Rank 0: the rollout controller on its own loop, admission restored to the resumed version,
    the progress endpoint, and with ``spec.agent`` the gateway the agent's episodes come through
    (instead of the dataset's, through the run's workflow)."""
    spec, algo = run.spec, run.spec.algorithm
    manager = StalenessManager(algo.batch_size // algo.group_size, spec.rollout.max_staleness,
                               max(1, spec.rollout.max_concurrent // algo.group_size))
    manager.restore(first_step)  # admission restarts at version × batch: no burst of stale samples
    data = examples(spec.dataset, spec.seed, data_position)
    workflow = None if spec.agent else make_workflow(
        spec, tokenizer, group_size=algo.group_size, temperature=spec.rollout.temperature,
        max_new_tokens=spec.rollout.max_new_tokens, reward_function=spec.reward.function)
    controller = RolloutController(InferenceClient(urls, api_token()), workflow, None if spec.agent else data, manager)
    controller.episodes = data_position
    controller.start()
    server = ProgressServer(Progress(step=first_step, first_step=first_step, version=first_step, max_steps=max_steps,
                                     phase="running"))
    server.start_in(controller.loop, int(os.environ.get(ENV_PROGRESS_PORT, "8080")))
    gateway = None
    if spec.agent is not None:
        gateway = Gateway(controller, tokenizer, GatewayConfig(
            model=run.experiment, group_size=algo.group_size, max_new_tokens=spec.rollout.max_new_tokens,
            temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
            session_timeout=spec.agent.session_timeout_seconds, reward=load_reward(spec.reward.function)),
            api_token(name=ENV_AGENT_TOKEN), tasks=data)  # agents never hold the pool's token
        gateway.start_in(int(os.environ.get(ENV_GATEWAY_PORT, GATEWAY_PORT)))
        server.add_counters("gateway", gateway.summary)  # kuberl_gateway_rejected, … on /metrics
    return controller, server, gateway


def set_up(run: RunConfig, rank: int, world: int, device: torch.device, urls: list[str]) -> Session:
    """Model and FSDP2 actor, resume from the newest checkpoint (or SFT warm-up and freeze π_ref),
    rollout and progress on rank 0, and the initial weights pushed to the pool."""
    spec = run.spec
    _require_fsdp(run)
    torch.manual_seed(spec.seed)
    model, tokenizer = load_model(spec.model, spec.seed)
    config = algorithm_config(run)
    actor = Actor.create(model, config, spec.algorithm.learning_rate, spec.rollout.temperature,
                         spec.algorithm.mini_batches, device, compute_dtype(spec.model.dtype, spec.trainer.accelerator))
    checkpointer = Checkpointer(os.environ.get(ENV_CHECKPOINT_URI) or spec.checkpoint.uri,
                                spec.checkpoint.every_steps, spec.checkpoint.keep,
                                Path(os.environ.get(ENV_STAGING_DIR, "/tmp/kuberl-staging")), rank,
                                int(os.environ.get("LOCAL_RANK", "0")), run.run_id)
    resumed: TrainerState | None = checkpointer.resume(actor)
    sft_losses: list[float] = []
    if resumed is None:
        warm = spec.model.sft_warmup
        sft_losses = sft_warmup(actor.model, tokenizer, examples(spec.dataset, spec.seed + 7), warm.steps,
                                warm.batch_size, warm.learning_rate, rank, world)
        actor.freeze_reference()  # π_ref is the policy RL starts from (a resume restores it instead)
    elif rank == 0:
        log.info("resumed from the checkpoint of step %d (version %d)", resumed.step, resumed.version)
    first_step = resumed.step if resumed else 0
    max_steps = int(os.environ.get(ENV_MAX_STEPS, spec.algorithm.max_steps))
    controller = server = gateway = None
    if rank == 0:
        position = resumed.data_position if resumed else 0
        controller, server, gateway = _start_rollout(run, tokenizer, first_step, position, max_steps, urls)
    sync = make_weight_sync(str(spec.weight_sync.mode), controller, rank, world, spec.weight_sync.directory)
    sync.push(actor, first_step)  # the pool gets the (resumed) weights before rollout starts
    sync.wait()
    if rank == 0:
        log.info("initial weights (version %d) pushed; SFT warm-up losses %s", first_step,
                 [round(x, 3) for x in sft_losses[::max(1, len(sft_losses) // 5)]])
    session = Session(run, rank, world, tokenizer, config, actor, checkpointer, sync, first_step, max_steps,
                      sft_losses, controller, server, gateway)
    if rank == 0:
        assert controller is not None
        session.curves = Curves.for_run(os.environ.get(ENV_CHECKPOINT_URI) or spec.checkpoint.uri)
        if spec.evaluation is not None:
            session.evaluations = Evaluations(spec, controller, tokenizer)
    return session


def take_batch(s: Session, step: int) -> tuple[list[Trajectory], list[float], float, int]:
    """Rank 0 takes the step's groups from the rollout buffer and shares them with every rank; if
    the pool is starved (every replica lost its weights), all ranks re-send the weights and retry.
    Returns (trajectories, advantages, seconds waited, groups filtered out)."""
    while True:
        batch_of_rank0: object = None
        if s.rank == 0:
            assert s.controller is not None
            wait_start = time.perf_counter()
            groups = s.controller.take(s.groups_per_step, step)
            if groups is not None:
                trajs, advs, dropped = build_batch(groups, s.config)
                batch_of_rank0 = (trajs, advs, time.perf_counter() - wait_start, dropped)
        payload = broadcast_from_rank0(batch_of_rank0)
        if payload is not None:
            return payload  # type: ignore[return-value]
        log.warning("step %d: every replica needs weights; re-sending version %d", step, step)
        s.sync.recover(s.actor, step)


def train_step(s: Session, step: int, trajs: list[Trajectory], advs: list[float]) -> dict[str, float] | None:
    """One decoupled-PPO step on this rank's rows at the schedule's learning rate (a rank without rows
    trains on a masked filler so the collectives line up); None when every group was filtered out."""
    if not trajs:
        log.warning("step %d: every group was filtered out (no reward variance); skipping", step)
        return None
    algo = s.run.spec.algorithm
    lr = learning_rate_at(step, s.max_steps, algo.learning_rate, str(algo.learning_rate_schedule),
                          algo.min_learning_rate_ratio)
    s.actor.set_learning_rate(lr)
    local = list(range(s.rank, len(trajs), s.world)) or [0]
    batch = collate([trajs[i] for i in local], [advs[i] for i in local], s.tokenizer.pad_token_id, version=step)
    if s.rank >= len(trajs):
        batch = batch.masked()
    return {**s.actor.train_step(batch, len(trajs)), "ppo_actor/learning_rate": lr}


def push_weights(s: Session, step: int, tally: Tally) -> float:
    """Wait for the previous exchange (it overlapped this step), then start pushing version step + 1;
    returns the previous exchange's seconds."""
    push_start = time.perf_counter()
    previous = s.sync.wait()
    if step > s.first_step:  # the first push of this process was waited for in set_up
        tally.timeperf["weight_sync"].append(previous)
    s.sync.push(s.actor, step + 1)
    tally.timeperf["weight_push"].append(time.perf_counter() - push_start)
    return previous


def report(s: Session, step: int, trajs: list[Trajectory], stats: dict[str, float] | None, wait_s: float,
           previous_sync: float, tally: Tally) -> None:
    """Rank 0: the step's log line, ``/progress`` and curves."""
    if s.rank != 0:
        return
    assert s.controller is not None and s.server is not None and s.curves is not None
    reward = mean([t.reward for t in trajs]) or 0.0
    tally.rewards.append(reward)
    multi_turn = bool(s.run.spec.rollout.tools or s.run.spec.agent)
    tools = mean([float(t.info.get("tool_calls", 0)) for t in trajs]) if multi_turn else None
    if tools is not None:
        tally.tool_calls.append(tools)
    entropy = stats.get("ppo_actor/entropy") if stats else None
    if entropy is not None and not math.isnan(entropy):
        tally.entropies.append(entropy)
    elapsed = time.perf_counter() - tally.start
    s.server.update(step=step + 1, version=step + 1, reward=reward, reward_first10=mean(tally.rewards[:10]),
                    reward_last10=mean(tally.rewards[-10:]), observed_staleness=s.controller.observed_staleness,
                    tokens_per_second=tally.trained_tokens / elapsed, step_seconds=tally.timeperf["step"][-1],
                    weight_sync_seconds=previous_sync, behav_logp_gap=tally.gaps.last,
                    entropy=tally.entropies[-1] if tally.entropies else None)
    gateway = {f"gateway/{k}": v for k, v in s.gateway.summary().items()} if s.gateway else {}
    s.curves.log(step + 1, {**(stats or {}), **gateway, "train/reward": reward, "rollout/tool_calls_per_episode": tools,
                            "rollout/observed_staleness":
                            s.controller.observed_staleness, "rollout/trained_tokens_per_second":
                            tally.trained_tokens / elapsed, **{f"timeperf/{k}": v[-1] for k, v in tally.timeperf.items()
                                                               if v}})
    if stats is not None:
        gap = tally.gaps.last if tally.gaps.last is not None else math.nan
        log.info("step %d/%d reward %.3f observed staleness %d loss %.4f entropy %.3f gap %.2g wait %.2fs sync %.3fs%s",
                 step + 1, s.max_steps, reward, s.controller.observed_staleness, stats["ppo_actor/loss"],
                 stats["ppo_actor/entropy"], gap, wait_s, previous_sync,
                 "" if tools is None else f" tool calls/episode {tools:.2f}")


def evaluate(s: Session, steps_done: int, last: bool = False) -> None:
    """Rank 0: start the held-out evaluation when due; report those that finished."""
    if s.evaluations is None:
        return
    s.evaluations.maybe_start(steps_done, last)
    record_evaluations(s, s.evaluations.finished())


def record_evaluations(s: Session, results: list[EvalResult]) -> None:
    assert s.server is not None and s.curves is not None
    for result in results:
        s.server.update(eval_step=result.step, eval_reward=result.reward, eval_pass_at_k=result.pass_at_k)
        s.curves.log(result.step, result.metrics())


def summarize(s: Session, tally: Tally) -> dict[str, object]:
    """Rank 0's run summary (``summary.json``, the termination message's source)."""
    assert s.controller is not None
    spec, wall = s.run.spec, time.perf_counter() - tally.start
    return {
        "steps": tally.steps_done,
        "resumed_from_step": s.first_step,
        "batch_size": spec.algorithm.batch_size,
        "reward_first10_mean": mean(tally.rewards[:10]),
        "reward_last10_mean": mean(tally.rewards[-10:]),
        "entropy_first10_mean": mean(tally.entropies[:10]),
        "entropy_last10_mean": mean(tally.entropies[-10:]),
        "observed_staleness": s.controller.observed_staleness,
        "max_token_staleness_trained": tally.token_staleness,
        "final_version": s.controller.manager.version,  # what every replica confirmed it serves
        **tally.gaps.summary(),
        "wall_seconds": round(wall, 3),
        "trained_tokens_per_second": round(tally.trained_tokens / wall, 1),
        "generated_tokens_per_second": round(s.controller.generated_tokens / wall, 1),
        "weight_sync_seconds_mean": round(mean(tally.timeperf["weight_sync"]) or 0.0, 4),
        **{f"timeperf/{k}_mean": round(mean(v) or 0.0, 4) for k, v in tally.timeperf.items()},
        "stale_groups_dropped": s.controller.buffer.dropped,
        "filtered_groups": tally.dropped_groups,
        "sft_warmup_final_loss": s.sft_losses[-1] if s.sft_losses else None,
        "max_staleness": spec.rollout.max_staleness,  # the bound η; observed_staleness stays at or below it
        "world_size": s.world,
        "replicas": len(s.controller.client.replicas),
        "rewards": [round(r, 4) for r in tally.rewards],
        "entropies": [round(h, 4) for h in tally.entropies],
        "tool_calls_per_episode": [round(x, 3) for x in tally.tool_calls] if tally.tool_calls else None,
        "eval": [{"step": e.step, "version": e.version, "reward": round(e.reward, 4),
                  f"pass@{e.k}": round(e.pass_at_k, 4), "length": round(e.length, 2)}
                 for e in (s.evaluations.history if s.evaluations else [])],
        "tensorboard": s.curves.location if s.curves else None,
        "gateway": s.gateway.summary() if s.gateway else None,
    }


def train(run: RunConfig, rank: int, world: int, device: torch.device, urls: list[str]) -> dict[str, object] | None:
    """The whole run; returns rank 0's summary (None on the other ranks)."""
    s = set_up(run, rank, world, device, urls)
    tally = Tally(BehaviourGapMonitor(warn=rank == 0), steps_done=s.first_step)
    watchdog = StepWatchdog(run.spec.trainer.step_timeout_seconds).start()
    if s.first_step == 0:
        evaluate(s, 0)  # the starting point (after the SFT warm-up) the curve rises from
    for step in range(s.first_step, s.max_steps):
        step_start = time.perf_counter()
        trajs, advs, wait_s, filtered = take_batch(s, step)
        tally.timeperf["wait_rollout"].append(wait_s)
        tally.dropped_groups += filtered
        tally.token_staleness = max([tally.token_staleness, *(step - v for t in trajs for v in t.trained_versions)])
        stats = train_step(s, step, trajs, advs)
        if stats is not None:
            tally.gaps.observe(step, stats)
            tally.timeperf["train_step"].append(stats["timeperf/train_step"])
            tally.trained_tokens += sum(t.trained_tokens for t in trajs)
        previous_sync = push_weights(s, step, tally)
        tally.timeperf["step"].append(time.perf_counter() - step_start)
        tally.steps_done = step + 1
        saved = s.checkpointer.maybe_save(s.actor, step + 1, step + 1, s.controller.episodes if s.controller else 0)
        if saved and s.server is not None and s.curves is not None:
            s.server.update(last_checkpoint=saved)
            s.curves.publish()
        watchdog.beat()  # the step and its checkpoint are done
        report(s, step, trajs, stats, wait_s, previous_sync, tally)
        evaluate(s, step + 1, last=step + 1 == s.max_steps)
    tally.timeperf["weight_sync"].append(s.sync.wait())
    watchdog.stop()
    if rank != 0:
        return None
    assert s.server is not None and s.controller is not None and s.curves is not None
    if s.evaluations is not None:
        record_evaluations(s, s.evaluations.wait(timeout=EVAL_WAIT_SECONDS))
    s.curves.close()
    log.info("training curves: %s (tensorboard --logdir %s)", s.curves.location, s.curves.location)
    summary = summarize(s, tally)
    s.server.update(phase="succeeded")
    s.server.write_termination_message(Path(os.environ.get(ENV_TERMINATION_LOG, TERMINATION_LOG)))
    if s.gateway is not None:
        s.gateway.stop()
    s.controller.stop()
    return summary
