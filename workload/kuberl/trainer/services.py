"""Rank 0's services, as one object: the rollout (a process of its own, :mod:`.rollout_process`, with
the agent gateway and the evaluations' episodes), the progress endpoint, the training curves and the
held-out evaluations' schedule.

``RankZeroServices`` is rank 0's; every other rank gets ``NoServices``, which does nothing, so the
training loop calls the same verbs on every rank and never asks which one it is (torchtitan's
metrics logger does the same on non-logging ranks). A new rank-0 service goes here: started in
``RankZeroServices.start``, fed in ``report`` / ``evaluate`` / ``checkpointed``, stopped in ``finish``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from ..api import Progress
from ..devices import compute_dtype, dtype_name
from ..inference.contract import ReplyLimits
from ..models.loading import model_origin
from ..policy.algorithms import AlgorithmConfig, build_batch
from ..policy.loss import BehaviourGapMonitor
from ..rollout.evaluation import EvalResult
from ..rollout.types import Group, Trajectory
from ..runconfig import RunConfig
from ..settings import Settings
from .checkpointing import TrainerState
from .curves import Curves
from .evaluations import Evaluations
from .progress import ProgressServer
from .pushes import PushTally
from .rollout_process import RolloutProcess
from .rollout_side import RolloutRecipe, RolloutSnapshot

log = logging.getLogger("kuberl.trainer")
EVAL_WAIT_SECONDS = 600.0  # the last evaluation, after the last step
WAIT_STEPS = 10  # the window of the fractions an autoscaler reads (rollout_pressure)
Batch = tuple[list[Trajectory], list[float], float, int]  # trajectories, advantages, seconds waited, groups filtered


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def fraction_of_steps(parts: list[float], steps: list[float], last: int = WAIT_STEPS) -> float | None:
    """Σ parts ÷ Σ steps over the ``last`` steps (seconds waited, or CPU seconds used, in each), at
    most 1; None until this process has trained ``last`` steps after its first (which waits for the
    start-up: the engines' first weights)."""
    if len(steps) <= last or len(parts) <= last:
        return None
    total = sum(steps[-last:])
    return round(min(1.0, sum(parts[-last:]) / total), 4) if total > 0 else 0.0


@dataclass
class Tally:
    """What the steps add up, for the progress line, ``/progress`` and the summary."""

    gaps: BehaviourGapMonitor
    steps_done: int
    start: float = field(default_factory=time.perf_counter)
    rewards: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # ppo_actor/entropy of each step that trained
    clip_ratios: list[float] = field(default_factory=list)  # ppo_actor/clip_ratio of each step that trained
    k3_kls: list[float] = field(default_factory=list)  # mismatch/k3_kl (KL(π_behav ‖ π_prox)) of each step
    update_kls: list[float] = field(default_factory=list)  # ppo_actor/update_kl (KL(π_new ‖ π_old)) of each step
    update_sizes: list[float] = field(default_factory=list)  # ppo_actor/update_size (‖Δθ‖ / ‖θ‖) of each step
    trained_tokens: int = 0
    token_staleness: int = 0
    dropped_groups: int = 0
    tool_calls: list[float] = field(default_factory=list)  # mean tool calls per episode, per step
    update_bytes: int = 0  # what each weight update carries to a replica (weights.sync.update_bytes)
    policy_bytes: int = 0  # the whole policy in the wire dtype (the same measure)
    timeperf: dict[str, list[float]] = field(default_factory=lambda: {
        "wait_rollout": [], "train_step": [], "weight_sync": [], "weight_push": [], "step": [], "rollout_cpu": []})
    report_seconds: list[float] = field(default_factory=list)  # wall seconds between reports (rollout_cpu's)
    pushes: PushTally = field(default_factory=PushTally)  # the weight exchanges' accounts (rank 0's)

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / max(time.perf_counter() - self.start, 1e-9)


def trainer_layout(run: RunConfig) -> dict[str, Any]:
    """Which backend trained, over which layout, computing in which dtype (the summary's ``trainer``)."""
    spec, (_, plan, _) = run.spec, run.resolved
    if plan is None:
        return {"backend": spec.trainer.backend.value}
    return {"backend": plan.backend.value, "data": plan.data, "tensor": plan.tensor, "pipeline": plan.pipeline,
            "expert": plan.expert, "dtype": dtype_name(compute_dtype(spec.model.dtype, spec.trainer.accelerator))}


def prompt_summary(state: dict[str, Any] | None) -> dict[str, int] | None:
    """The ledger in the summary: counts, with the pending prompts counted rather than listed."""
    if state is None:
        return None
    return {"cursor": state["cursor"], "trained": state["trained"], "reissued": state["reissued"],
            "skipped": state["skipped"], "pending": len(state["pending"])}


def length_curves(lengths: dict[str, Any]) -> dict[str, float | None]:
    """The curves of which episodes training sees (``kuberl.rollout.lengths``): the mean output length of
    those generated, trained and dropped so far, and the KS distance between generated and trained."""
    return {**{f"rollout/{kind}_length_mean": lengths[kind]["mean"] for kind in ("generated", "trained", "dropped")},
            "rollout/length_ks_generated_trained": lengths["ks_generated_trained"]}


def trust_region_summary(tally: Tally) -> dict[str, float | None]:
    """How much the PPO clip acted: the mean share of tokens it clipped per step, the share of steps on
    which it clipped any; the largest KL(π_behav ‖ π_prox) a step trained on (``mismatch/k3_kl``: how far
    the policy had moved since its samples were drawn); and how far the steps themselves moved it
    (``kuberl.policy.update_size``): the largest and the median KL(π_new ‖ π_old) of a step, the largest
    and the median ‖Δθ‖ / ‖θ‖."""
    clips = tally.clip_ratios

    def rounded(values: list[float], pick: Callable[[list[float]], float]) -> float | None:
        return float(f"{pick(values):.4g}") if values else None

    return {"clip_ratio_mean": round(mean(clips), 5) if clips else None,
            "clip_active_share": round(sum(c > 0 for c in clips) / len(clips), 4) if clips else None,
            "k3_kl_max": round(max(tally.k3_kls), 5) if tally.k3_kls else None,
            "update_kl_max": rounded(tally.update_kls, max), "update_kl_median": rounded(tally.update_kls, median),
            "update_size_max": rounded(tally.update_sizes, max),
            "update_size_median": rounded(tally.update_sizes, median)}


class NoServices:
    """Every rank but 0: no rollout, no endpoints, no curves; each verb does nothing."""

    control: RolloutProcess | None = None  # what the weight exchange talks to the pool through
    sample_spans: tuple[tuple[int, int], ...] = ()  # the last batch's traced sample spans (trace id, span id)

    def data_state(self) -> tuple[int, dict[str, Any] | None]:
        """What a checkpoint keeps of the data: the position in the stream and the prompt ledger
        (rank 0's count; the other ranks' is never read)."""
        return 0, None

    def next_batch(self, groups: int, step: int, config: AlgorithmConfig) -> Batch | None:
        return None

    def report(self, step: int, trajs: list[Trajectory], stats: dict[str, float] | None, wait_s: float,
               previous_sync: float, tally: Tally) -> None:
        return None

    def checkpointed(self, uri: str | None) -> None:
        return None

    def exported(self, export: dict[str, Any] | None) -> None:
        return None

    def evaluate(self, steps_done: int, last: bool = False) -> None:
        return None

    def before_push(self, version: int) -> None:
        return None

    def finish(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any] | None:
        return None


class RankZeroServices(NoServices):
    def __init__(self, run: RunConfig, settings: Settings, rollout: RolloutProcess, server: ProgressServer,
                 curves: Curves, evaluations: Evaluations | None, max_steps: int, tokenizer: Any):
        self.run, self.settings, self.max_steps = run, settings, max_steps
        self.rollout, self.server, self.curves, self.evaluations = rollout, server, curves, evaluations
        self.control = rollout
        self.model = model_origin(run.spec.model, tokenizer)
        self.export: dict[str, Any] | None = None
        self.latest = rollout.snapshot()
        self._last_sample = (time.perf_counter(), self.latest.cpu_seconds)
        self.server.update(model_revision=self.model.get("revision"), init_from=self.model.get("init_from"))
        if run.spec.agent is not None:  # kuberl_gateway_rejected, … on /metrics, as of the last report
            self.server.add_counters("gateway", lambda: self.latest.gateway or {})

    @classmethod
    def start(cls, run: RunConfig, settings: Settings, tokenizer: Any, first_step: int, resumed: TrainerState | None,
              max_steps: int, urls: list[str], rollout: RolloutProcess, limits: ReplyLimits) -> RankZeroServices:
        """The rollout process built (:class:`~.rollout_side.RolloutSide`: the controller, the prompts
        where the resumed run left them, the gateway, the evaluations' episodes) and serving, the
        progress endpoint, the curves and the evaluations' schedule."""
        rollout.build(RolloutRecipe(run, settings, tokenizer, first_step, resumed.data_position if resumed else 0,
                                    resumed.prompts if resumed else None, urls, limits))
        server = ProgressServer(Progress(step=first_step, first_step=first_step, version=first_step,
                                         max_steps=max_steps, phase="running"))
        server.serve_in_thread(settings.progress_port, settings.bind_host)
        curves = Curves.for_run(run, settings)
        ev = run.spec.evaluation
        hold = min(EVAL_WAIT_SECONDS, run.spec.trainer.step_timeout_seconds / 2)  # the watchdog never fires on it
        evaluations = Evaluations(ev.every_steps, rollout.start_evaluation, hold) if ev is not None else None
        return cls(run, settings, rollout, server, curves, evaluations, max_steps, tokenizer)

    def data_state(self) -> tuple[int, dict[str, Any] | None]:
        return self.rollout.data_state()

    def next_batch(self, groups: int, step: int, config: AlgorithmConfig) -> Batch | None:
        """The step's groups from the rollout buffer as a batch; None when the pool is starved. The next
        step's are taken ahead meanwhile (``RolloutController.take``), except after the last step."""
        wait_start = time.perf_counter()
        taken = self.rollout.take(groups, step, ahead=step + 1 < self.max_steps)
        if taken is None:
            return None
        trajs, advs, dropped = build_batch(taken, config)
        self._audit(step, taken, trajs)
        self.sample_spans = tuple(g.sample_span for g in taken if g.sample_span is not None)
        return trajs, advs, time.perf_counter() - wait_start, dropped

    def _audit(self, step: int, groups: list[Group], trajs: list[Trajectory]) -> None:
        """Step ``step + 1``'s prompts (ledger numbers) and reward, one JSON line in ``settings.prompts_log``.
        A restarted gang writes the steps after its checkpoint again: a step's last line is the one the
        final weights descend from (``benchmarks/chaos.py`` checks exactly-once from it)."""
        if self.settings.prompts_log is None:
            return
        prompts = sorted(g.prompt for g in groups if g.prompt is not None)
        line = {"step": step + 1, "prompts": prompts, "reward": round(mean([t.reward for t in trajs]) or 0.0, 4)}
        with self.settings.prompts_log.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def report(self, step: int, trajs: list[Trajectory], stats: dict[str, float] | None, wait_s: float,
               previous_sync: float, tally: Tally) -> None:
        """The step's log line, ``/progress`` and curves."""
        rollout = self._sample_rollout(tally)
        reward = mean([t.reward for t in trajs]) or 0.0
        tally.rewards.append(reward)
        multi_turn = bool(self.run.spec.rollout.tools or self.run.spec.agent)
        tools = mean([float(t.info.get("tool_calls", 0)) for t in trajs]) if multi_turn else None
        if tools is not None:
            tally.tool_calls.append(tools)
        for key, kept in (("ppo_actor/entropy", tally.entropies), ("ppo_actor/clip_ratio", tally.clip_ratios),
                          ("mismatch/k3_kl", tally.k3_kls), ("ppo_actor/update_kl", tally.update_kls),
                          ("ppo_actor/update_size", tally.update_sizes)):
            value = stats.get(key) if stats else None
            if value is not None and not math.isnan(value):
                kept.append(value)
        staleness, prompts = rollout.observed_staleness, rollout.prompt_counts
        self.server.update(step=step + 1, version=step + 1, reward=reward, reward_first10=mean(tally.rewards[:10]),
                           reward_last10=mean(tally.rewards[-10:]), observed_staleness=staleness,
                           late_groups_trained=rollout.late_groups_trained,
                           tokens_per_second=tally.tokens_per_second, step_seconds=tally.timeperf["step"][-1],
                           weight_sync_seconds=previous_sync, behav_logp_gap=tally.gaps.last,
                           entropy=tally.entropies[-1] if tally.entropies else None,
                           prompts_trained=prompts.get("trained"), prompts_reissued=prompts.get("reissued"),
                           prompts_skipped=prompts.get("skipped"), reward_timeouts=rollout.reward_timeouts,
                           reward_errors=rollout.reward_errors, prompts_too_long=rollout.prompts_too_long,
                           **self.rollout_pressure(tally, rollout), **tally.pushes.progress())
        gateway = {f"gateway/{k}": v for k, v in (rollout.gateway or {}).items()}
        self.curves.log(step + 1, {
            **(stats or {}), **gateway, "train/reward": reward, "rollout/tool_calls_per_episode": tools,
            "rollout/observed_staleness": staleness, "rollout/trained_tokens_per_second": tally.tokens_per_second,
            "rollout/late_groups_trained": rollout.late_groups_trained,
            **length_curves(rollout.episode_lengths),
            **{f"timeperf/{k}": v[-1] for k, v in tally.timeperf.items() if v}})
        if stats is not None:
            gap = tally.gaps.last if tally.gaps.last is not None else math.nan
            log.info("step %d/%d reward %.3f observed staleness %d loss %.4f entropy %.3f gap %.2g wait %.2fs "
                     "sync %.3fs%s", step + 1, self.max_steps, reward, staleness, stats["ppo_actor/loss"],
                     stats["ppo_actor/entropy"], gap, wait_s, previous_sync,
                     "" if tools is None else f" tool calls/episode {tools:.2f}")

    def _sample_rollout(self, tally: Tally) -> RolloutSnapshot:
        """The rollout's numbers now (``self.latest``), with the rollout process's CPU seconds since the
        last report (``timeperf/rollout_cpu``) and the wall seconds between the two (``Tally.report_seconds``)."""
        wall, self.latest = time.perf_counter(), self.rollout.snapshot()
        (last_wall, last_cpu), self._last_sample = self._last_sample, (wall, self.latest.cpu_seconds)
        tally.timeperf["rollout_cpu"].append(self.latest.cpu_seconds - last_cpu)
        tally.report_seconds.append(wall - last_wall)
        return self.latest

    def rollout_pressure(self, tally: Tally, rollout: RolloutSnapshot) -> dict[str, float | int | None]:
        """What an autoscaler reads (``/progress``, ``/metrics``): the share of the last
        :data:`WAIT_STEPS` steps' seconds spent waiting for rollouts (Σ wait ÷ Σ step: one step's share
        swings with an evaluation or a weight update), the groups ready ahead of the trainer, the
        staleness window in use (:attr:`~kuberl.rollout.staleness.StalenessManager.budget_used`), as of
        ``rollout``; and the CPU share the rollout process took of those seconds (what it needs beside
        the trainer: on a cluster, of the trainer pod's CPU)."""
        return {"rollout_wait_fraction": fraction_of_steps(tally.timeperf["wait_rollout"], tally.timeperf["step"]),
                "rollout_cpu_fraction": fraction_of_steps(tally.timeperf["rollout_cpu"], tally.report_seconds),
                "rollout_ready_groups": rollout.ready_groups,
                "staleness_budget_used": round(rollout.budget_used, 4)}
    def checkpointed(self, uri: str | None) -> None:
        """A checkpoint was saved (``uri``; None: none was due): say so and publish the curves next to it."""
        if uri is not None:
            self.server.update(last_checkpoint=uri)
            self.curves.publish()

    def exported(self, export: dict[str, Any] | None) -> None:
        """The policy was exported as a Hugging Face directory (``export``: its uri, step, bytes, seconds)."""
        if export is not None:
            self.export = export
            self.server.update(last_export=export["uri"])
            self.curves.note("export/uri", export["uri"])

    def evaluate(self, steps_done: int, last: bool = False) -> None:
        """Start the held-out evaluation when due; report those that finished."""
        if self.evaluations is not None:
            self.evaluations.maybe_start(steps_done, last)
            self._record(self.evaluations.finished(steps_done))

    def before_push(self, version: int) -> None:
        """Before the weight update of ``version``: a running evaluation of an older version finishes
        first (:meth:`.evaluations.Evaluations.hold`)."""
        if self.evaluations is not None:
            self.evaluations.hold(version)

    def _record(self, results: list[EvalResult]) -> None:
        for result in results:
            self.server.update(eval_step=result.step, eval_reward=result.reward, eval_pass_at_k=result.pass_at_k,
                               eval_version=result.version, eval_version_span=result.version_span)
            self.curves.log(result.step, result.metrics())

    def finish(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any]:
        """After the last step: the last evaluation, the curves closed, the summary and the final progress
        (the termination message the operator reads), then every service stopped. Returns the summary."""
        if self.evaluations is not None:
            self._record(self.evaluations.wait(EVAL_WAIT_SECONDS, tally.steps_done))
        self.curves.close()
        log.info("training curves: %s (tensorboard --logdir %s)", self.curves.location, self.curves.location)
        summary = self.summarize(tally, first_step, sft_losses, world)
        self.server.update(phase="succeeded", **tally.pushes.progress())  # with the push after the last step
        self.server.write_termination_message(self.settings.termination_log)
        self.rollout.stop()
        self.server.close()
        return summary

    def summarize(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any]:
        """The run summary (``summary.json``, the termination message's source)."""
        spec, wall, rollout = self.run.spec, time.perf_counter() - tally.start, self.rollout.snapshot()
        return {
            "steps": tally.steps_done,
            "resumed_from_step": first_step,
            "batch_size": spec.algorithm.batch_size,
            "reward_first10_mean": mean(tally.rewards[:10]),
            "reward_last10_mean": mean(tally.rewards[-10:]),
            "entropy_first10_mean": mean(tally.entropies[:10]),
            "entropy_last10_mean": mean(tally.entropies[-10:]),
            **trust_region_summary(tally),
            "observed_staleness": rollout.observed_staleness,
            "max_token_staleness_trained": tally.token_staleness,
            "final_version": rollout.version,  # what every replica confirmed it serves
            **tally.gaps.summary(),
            "wall_seconds": round(wall, 3),
            "trained_tokens_per_second": round(tally.trained_tokens / wall, 1),
            "generated_tokens_per_second": round(rollout.generated_tokens / wall, 1),
            "weight_sync_seconds_mean": round(mean(tally.timeperf["weight_sync"]) or 0.0, 4),
            "weight_update_bytes": tally.update_bytes,
            "weight_update_fraction": round(tally.update_bytes / tally.policy_bytes, 5) if tally.policy_bytes else None,
            "weight_pushes": tally.pushes.summary(),
            **{f"timeperf/{k}_mean": round(mean(v) or 0.0, 4) for k, v in tally.timeperf.items()},
            "stale_groups_dropped": rollout.stale_groups_dropped,
            "late_groups_trained": rollout.late_groups_trained,
            "episode_lengths": rollout.episode_lengths,
            "prompts": prompt_summary(self.rollout.data_state()[1]),
            "reward_timeouts": rollout.reward_timeouts,
            "reward_errors": rollout.reward_errors,
            "dataset": self.rollout.dataset(),
            "model": self.model,
            "export": self.export,
            "filtered_groups": tally.dropped_groups,
            "sft_warmup_final_loss": sft_losses[-1] if sft_losses else None,
            "max_staleness": spec.rollout.max_staleness,  # η: beyond it only late_groups_trained (lateGroups: train)
            "late_groups": spec.rollout.late_groups.value,
            "world_size": world,
            "trainer": trainer_layout(self.run),
            "replicas": rollout.replicas,
            "rewards": [round(r, 4) for r in tally.rewards],
            "entropies": [round(h, 4) for h in tally.entropies],
            "tool_calls_per_episode": [round(x, 3) for x in tally.tool_calls] if tally.tool_calls else None,
            "eval": self.evaluation_summary(),
            "eval_skipped": self.evaluations.skipped if self.evaluations else [],
            "tensorboard": self.curves.location,
            "gateway": rollout.gateway,
        }

    def evaluation_summary(self) -> list[dict[str, Any]]:
        """Each evaluation: the step it was due after, the policy versions that wrote it (the oldest and
        how many), the step after which it was recorded, its metrics."""
        evaluations = self.evaluations
        if evaluations is None:
            return []
        return [{"step": e.step, "version": e.version, "version_span": e.version_span,
                 "reported_after_step": evaluations.reported_after[e.step], "reward": round(e.reward, 4),
                 f"pass@{e.k}": round(e.pass_at_k, 4), "length": round(e.length, 2), "seconds": e.seconds}
                for e in evaluations.history]
