"""The training loop, top-down (``train``), and its named steps.

Every step: take a fresh batch (rank 0 takes it from the rollout and shares it) → advantages →
decoupled PPO step (FSDP2 or Megatron-core: ``make_actor``) → push the new weights to every
inference replica (overlapping the next step) → checkpoint when due → report. Version v = weights
after v steps. What only rank 0 does (rollout, progress endpoint, gateway, curves, evaluations) is
``services`` (``.services``): a no-op twin on the other ranks, so this module never asks which rank
it runs on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace

from .. import tracing
from ..api.support import unsupported_issues
from ..collectives import broadcast_from_rank0
from ..data.datasets import examples
from ..devices import compute_dtype
from ..fsdp.actor import build_critic
from ..inference.contract import ReplyLimits
from ..interpreter import freeze_set_up_heap
from ..models.loading import load_model, load_skeleton
from ..policy.actor import Actor
from ..policy.algorithms import AlgorithmConfig, learning_rate_at
from ..policy.backend import BackendInputs
from ..policy.batch import collate
from ..policy.critic import Critic, CriticConfig
from ..policy.loss import BehaviourGapMonitor
from ..rollout.types import Trajectory, version_lag
from ..runconfig import RunConfig
from ..settings import Settings
from ..weights.sync import WeightSync, make_weight_sync, update_bytes
from .backends import builder
from .checkpointing import Checkpointer, TrainerState
from .export import describe_model, export_due, export_policy, hf_config
from .model_fit import model_issues
from .rollout_process import RolloutProcess
from .services import NoServices, RankZeroServices, Tally
from .watchdog import StepWatchdog
from .workflows import PromptCheck

log = logging.getLogger("kuberl.trainer")
tracer = trace.get_tracer("kuberl.trainer")  # a no-op until kuberl.tracing.set_up installs a provider (rank 0)


@dataclass
class Session:
    """What every step of one run shares."""

    run: RunConfig
    settings: Settings
    rank: int
    world: int
    tokenizer: Any
    config: AlgorithmConfig
    actor: Actor
    checkpointer: Checkpointer
    sync: WeightSync
    first_step: int
    max_steps: int
    sft_losses: list[float]
    services: NoServices  # RankZeroServices on rank 0
    exchanges: tracing.ExchangeSpans = field(default_factory=tracing.ExchangeSpans)  # traced weight exchanges

    @property
    def groups_per_step(self) -> int:
        algo = self.run.spec.algorithm
        return algo.batch_size // algo.group_size


def algorithm_config(run: RunConfig) -> AlgorithmConfig:
    spec, algo = run.spec, run.spec.algorithm
    return AlgorithmConfig(
        name=algo.name, group_size=algo.group_size, clip_low=algo.clip.low, clip_high=algo.clip.high,
        dual_clip=algo.clip.dual, kl_coef=algo.kl_coef, behavior_imp_cap=algo.behavior_imp_cap,
        max_new_tokens=spec.rollout.max_new_tokens, correction=algo.importance_sampling.mode,
        correction_level=algo.importance_sampling.level, behavior_imp_low=algo.importance_sampling.low,
        ratio_level=algo.ratio, clip_anchor=algo.clip_anchor,
    )


def critic_config(run: RunConfig) -> CriticConfig | None:
    """``ppo``'s critic as the actor builds it (``spec.algorithm.critic`` or its defaults); None otherwise."""
    critic = run.spec.algorithm.value_model
    if critic is None:
        return None
    return CriticConfig(critic.learning_rate, critic.gamma, critic.gae_lambda, critic.value_clip)


def make_actor(run: RunConfig, model: torch.nn.Module, device: torch.device, weights: Path | None = None) -> Actor:
    """The actor of ``spec.trainer.backend`` (:mod:`.backends`: FSDP2 over every rank, or Megatron-core with
    tensor, pipeline, context, expert and data parallelism), after the checks a spec that reached the
    trainer unvalidated would fail: ``kuberl.api.support`` (which layouts this build trains) and
    :func:`.model_fit.model_issues` (what the model's architecture refuses). ``weights``: where a
    ``meta`` model's files are (each rank reads only its own pieces)."""
    spec = run.spec
    _, plan, issues = run.resolved
    issues = issues + unsupported_issues(spec, plan)
    if not issues:
        issues += model_issues(spec, model)
    if issues or plan is None:
        raise SystemExit("invalid spec: " + "; ".join(map(str, issues)))
    dtype, critic = compute_dtype(spec.model.dtype, spec.trainer.accelerator), critic_config(run)

    def hf_critic() -> Critic:
        assert critic is not None
        return build_critic(model, critic, device, dtype, weights)

    inputs = BackendInputs(spec, plan, model, device, weights, algorithm_config(run), dtype, critic, hf_critic)
    return builder(plan.backend)(inputs)


def set_up(run: RunConfig, settings: Settings, rank: int, world: int, device: torch.device,
           urls: list[str]) -> Session:
    """Model and FSDP2 actor, resume from the newest checkpoint (or SFT warm-up and freeze π_ref),
    rank 0's services, and the initial weights pushed to the pool. Rank 0's rollout process starts
    first (its imports overlap the model's loading). What set-up leaves alive is then frozen out of
    the garbage collector's reach (:func:`~kuberl.interpreter.freeze_set_up_heap`)."""
    spec = run.spec
    rollout = RolloutProcess.launch(settings.rollout_cores) if rank == 0 else None
    if rank == 0:
        tracing.set_up(spec.observability, settings, "kuberl-trainer")
    torch.manual_seed(spec.seed)
    _, plan, _ = run.resolved
    if plan is not None:  # built on meta; each rank reads only its own pieces of the files
        model, tokenizer, weights = load_skeleton(spec.model, spec.seed, settings)
    else:
        (model, tokenizer), weights = load_model(spec.model, spec.seed, settings), None
    config = algorithm_config(run)
    limits = ReplyLimits.of(model)  # before make_actor wraps or shards it
    actor = make_actor(run, model, device, weights)
    checkpointer = Checkpointer(settings.checkpoint_location(spec.checkpoint.uri), spec.checkpoint.every_steps,
                                spec.checkpoint.keep, settings.staging_dir, rank, settings.local_rank, run.run_id,
                                settings.s3_endpoint, lambda where: describe_model(hf_config(actor), tokenizer, where),
                                settings.checkpoint_key)
    resumed: TrainerState | None = checkpointer.resume(actor)
    sft_losses: list[float] = []
    if resumed is None:
        warm = spec.model.sft_warmup
        check = PromptCheck.of(spec, tokenizer)  # the rollout's rendering and length limit
        demonstrations = examples(spec.dataset, spec.seed + 7, 0, settings, check.keep)
        sft_losses = actor.supervised_warm_up(check.codec, demonstrations, warm.steps, warm.batch_size,
                                              warm.learning_rate)
        actor.freeze_reference()  # π_ref is the policy RL starts from (a resume restores it instead)
        if warm.steps:
            actor.start_critic()  # and so is the critic's transformer
        log.info("SFT warm-up losses %s", [round(x, 3) for x in sft_losses[::max(1, len(sft_losses) // 5)]])
    else:
        log.info("resumed from the checkpoint of step %d (version %d)", resumed.step, resumed.version)
    first_step = resumed.step if resumed else 0
    max_steps = settings.max_steps if settings.max_steps is not None else spec.algorithm.max_steps
    services = (RankZeroServices.start(run, settings, tokenizer, first_step, resumed, max_steps, urls, rollout,
                                       limits) if rollout is not None else NoServices())
    sync = make_weight_sync(spec.weight_sync.mode, services.control, settings, rank, world,
                            spec.weight_sync.directory, spec.weight_sync.relay)
    sync.push(actor.weight_source(), first_step)  # the pool gets the (resumed) weights before rollout starts
    sync.wait()
    log.info("initial weights (version %d) pushed", first_step)
    freeze_set_up_heap()
    return Session(run, settings, rank, world, tokenizer, config, actor, checkpointer, sync, first_step, max_steps,
                   sft_losses, services)


def take_batch(s: Session, step: int) -> tuple[list[Trajectory], list[float], float, int]:
    """Rank 0 takes the step's groups from the rollout buffer and shares them with every rank; if
    the pool is starved (every replica lost its weights), all ranks re-send the weights and retry.
    Returns (trajectories, advantages, seconds waited, groups filtered out)."""
    while True:
        payload = broadcast_from_rank0(s.services.next_batch(s.groups_per_step, step, s.config))
        if payload is not None:
            return payload  # type: ignore[return-value]
        log.warning("step %d: every replica needs weights; re-sending version %d", step, step)
        s.sync.recover(s.actor.weight_source(), step)


def train_step(s: Session, step: int, trajs: list[Trajectory], advs: list[float]) -> dict[str, float] | None:
    """One decoupled-PPO step on this rank's rows at the schedule's learning rate (a rank without rows
    trains on a masked filler so the collectives line up); None when every group was filtered out."""
    if not trajs:
        log.warning("step %d: every group was filtered out (no reward variance); skipping", step)
        return None
    algo = s.run.spec.algorithm
    lr = learning_rate_at(step, s.max_steps, algo.learning_rate, algo.learning_rate_schedule,
                          algo.min_learning_rate_ratio, algo.warmup_steps)
    s.actor.set_learning_rate(lr, share=lr / algo.learning_rate)
    data_rank, data_ranks = s.actor.data_parallel()
    local = list(range(data_rank, len(trajs), data_ranks)) or [0]
    batch = collate([trajs[i] for i in local], [advs[i] for i in local], s.tokenizer.pad_token_id, version=step)
    if data_rank >= len(trajs):
        batch = batch.masked()
    return {**s.actor.train_step(batch, len(trajs)), "ppo_actor/learning_rate": lr}


def push_weights(s: Session, step: int, tally: Tally) -> float:
    """Wait for the previous exchange (it overlapped this step) and for a running evaluation (it measures
    one version), then start pushing version step + 1; returns the previous exchange's seconds."""
    push_start = time.perf_counter()
    previous = s.sync.wait()
    account = s.sync.take_push()
    tally.pushes.add(account)
    s.exchanges.ended(account)
    if step > s.first_step:  # the first push of this process was waited for in set_up
        tally.timeperf["weight_sync"].append(previous)
    s.services.before_push(step + 1)  # an evaluation of an older version finishes first
    s.exchanges.started(step + 1, time.time_ns())
    s.sync.push(s.actor.weight_source(), step + 1)
    tally.timeperf["weight_push"].append(time.perf_counter() - push_start)
    return previous


def count(tally: Tally, step: int, trajs: list[Trajectory], stats: dict[str, float] | None, wait_s: float,
          filtered: int) -> int:
    """Add one step's batch and training statistics to the tally; returns the batch's staleness (the
    largest version lag of its tokens)."""
    staleness = version_lag(step, trajs)
    tally.timeperf["wait_rollout"].append(wait_s)
    tally.dropped_groups += filtered
    tally.token_staleness = max(tally.token_staleness, staleness)
    if stats is not None:
        tally.gaps.observe(step, stats)
        tally.timeperf["train_step"].append(stats["timeperf/train_step"])
        tally.trained_tokens += sum(t.trained_tokens for t in trajs)
    return staleness


def maybe_export(s: Session, steps_done: int) -> None:
    """The policy as a Hugging Face directory when ``spec.export`` asks for one after ``steps_done``
    steps (every rank takes part: the weights are gathered; rank 0 writes it beside the checkpoints)."""
    spec = s.run.spec
    if export_due(spec.export, steps_done, spec.checkpoint.every_steps, last=steps_done == s.max_steps):
        s.services.exported(export_policy(
            s.actor, s.tokenizer, steps_done, s.settings.checkpoint_location(spec.checkpoint.uri), spec.export,
            s.settings.staging_dir, s.run.run_id, s.rank, s.settings.s3_endpoint, base_model=spec.model.path))


def train(run: RunConfig, settings: Settings, rank: int, world: int, device: torch.device,
          urls: list[str]) -> dict[str, object] | None:
    """The whole run; returns rank 0's summary (None on the other ranks)."""
    s = set_up(run, settings, rank, world, device, urls)
    tally = Tally(BehaviourGapMonitor(warn=rank == 0), steps_done=s.first_step,
                  update_bytes=update_bytes(s.actor.weight_source()), policy_bytes=update_bytes(s.actor))
    watchdog = StepWatchdog(run.spec.trainer.step_timeout_seconds).start()
    if s.first_step == 0:
        s.services.evaluate(0)  # the starting point (after the SFT warm-up) the curve rises from
    for step in range(s.first_step, s.max_steps):
        one_step(s, step, tally, watchdog)
    tally.timeperf["weight_sync"].append(s.sync.wait())
    account = s.sync.take_push()
    tally.pushes.add(account)
    s.exchanges.ended(account)
    watchdog.stop()
    summary = s.services.finish(tally, s.first_step, s.sft_losses, world)
    tracing.shut_down()
    return summary


def one_step(s: Session, step: int, tally: Tally, watchdog: StepWatchdog) -> None:
    """Step ``step``: its batch, the update, the push of version step + 1, a checkpoint and export when due,
    the report and an evaluation when due; a ``step`` span with one per phase (rank 0, when traced)."""
    with tracer.start_as_current_span("step", attributes={"kuberl.step": step}) as span:
        step_start = time.perf_counter()
        with tracer.start_as_current_span("wait_rollout"):
            trajs, advs, wait_s, filtered = take_batch(s, step)
        tracing.link(span, s.services.sample_spans)  # the samples this step trains, each in a trace of its own
        with tracer.start_as_current_span("train"):
            stats = train_step(s, step, trajs, advs)
        staleness = count(tally, step, trajs, stats, wait_s, filtered)
        with tracer.start_as_current_span("weight_push"):
            previous_sync = push_weights(s, step, tally)
        tally.timeperf["step"].append(time.perf_counter() - step_start)
        tally.steps_done = step + 1
        span.set_attributes({"kuberl.samples": len(trajs), "kuberl.staleness": staleness,
                             "kuberl.previous_sync_seconds": previous_sync})
        if s.checkpointer.due(step + 1):  # the data state is asked of the rollout loop only then
            with tracer.start_as_current_span("checkpoint"):
                s.services.checkpointed(s.checkpointer.maybe_save(s.actor, step + 1, step + 1,
                                                                  *s.services.data_state()))
        maybe_export(s, step + 1)
        watchdog.beat()  # the step, its checkpoint and export are done
        s.services.report(step, trajs, stats, wait_s, previous_sync, tally)
        s.services.evaluate(step + 1, last=step + 1 == s.max_steps)
