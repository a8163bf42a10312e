"""Rank 0's services, as one object: the rollout controller (its own thread and event loop), the
progress endpoint, the agent gateway, the training curves and the held-out evaluations.

``RankZeroServices`` is rank 0's; every other rank gets ``NoServices``, which does nothing, so the
training loop calls the same verbs on every rank and never asks which one it is (torchtitan's
metrics logger does the same on non-logging ranks). A new rank-0 service goes here: started in
``RankZeroServices.start``, fed in ``report`` / ``evaluate`` / ``checkpointed``, stopped in ``finish``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..api import Progress, resolve
from ..api.spec import RLExperimentSpec
from ..data.datasets import examples
from ..devices import compute_dtype, dtype_name
from ..gateway.server import Gateway, GatewayConfig
from ..models.loading import model_origin
from ..policy.algorithms import AlgorithmConfig, build_batch
from ..policy.loss import BehaviourGapMonitor
from ..rewards.pool import Scorer
from ..rollout.client import InferenceClient
from ..rollout.controller import RolloutController
from ..rollout.evaluation import EvalResult
from ..rollout.ledger import PromptLedger
from ..rollout.staleness import StalenessManager
from ..rollout.types import Group, Trajectory
from ..runconfig import RunConfig
from ..settings import Settings
from .checkpointing import TrainerState
from .curves import Curves
from .evaluations import Evaluations
from .pool import follow_pool, pool_source
from .progress import ProgressServer
from .workflows import PromptCheck, make_reward, make_workflow

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
    trained_tokens: int = 0
    token_staleness: int = 0
    dropped_groups: int = 0
    tool_calls: list[float] = field(default_factory=list)  # mean tool calls per episode, per step
    update_bytes: int = 0  # what each weight update carries to a replica (weights.sync.update_bytes)
    policy_bytes: int = 0  # the whole policy in the wire dtype (the same measure)
    timeperf: dict[str, list[float]] = field(default_factory=lambda: {
        "wait_rollout": [], "train_step": [], "weight_sync": [], "weight_push": [], "step": [], "rollout_cpu": []})
    report_seconds: list[float] = field(default_factory=list)  # wall seconds between reports (rollout_cpu's)

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / max(time.perf_counter() - self.start, 1e-9)


def trainer_layout(spec: RLExperimentSpec) -> dict[str, Any]:
    """Which backend trained, over which layout, computing in which dtype (the summary's ``trainer``)."""
    _, plan, _ = resolve(spec)
    if plan is None:
        return {"backend": str(spec.trainer.backend)}
    return {"backend": str(plan.backend), "data": plan.data, "tensor": plan.tensor, "pipeline": plan.pipeline,
            "expert": plan.expert, "dtype": dtype_name(compute_dtype(spec.model.dtype, spec.trainer.accelerator))}


def prompt_summary(state: dict[str, Any] | None) -> dict[str, int] | None:
    """The ledger in the summary: counts, with the pending prompts counted rather than listed."""
    if state is None:
        return None
    return {"cursor": state["cursor"], "trained": state["trained"], "reissued": state["reissued"],
            "skipped": state["skipped"], "pending": len(state["pending"])}


class NoServices:
    """Every rank but 0: no rollout, no endpoints, no curves; each verb does nothing."""

    control: RolloutController | None = None  # what the weight exchange talks to the pool through

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

    def finish(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any] | None:
        return None


class RankZeroServices(NoServices):
    def __init__(self, run: RunConfig, settings: Settings, controller: RolloutController, server: ProgressServer,
                 gateway: Gateway | None, curves: Curves, evaluations: Evaluations | None, max_steps: int,
                 reward: Scorer, prompts: PromptCheck):
        self.run, self.settings, self.max_steps = run, settings, max_steps
        self.controller, self.server, self.gateway = controller, server, gateway
        self.curves, self.evaluations = curves, evaluations
        self.control = controller
        self.reward, self.prompt_check = reward, prompts
        self.model = model_origin(run.spec.model, prompts.codec.tokenizer)
        self.export: dict[str, Any] | None = None
        self._last_sample = (time.perf_counter(), controller.cpu_seconds())
        self.server.update(model_revision=self.model.get("revision"), init_from=self.model.get("init_from"))

    @classmethod
    def start(cls, run: RunConfig, settings: Settings, tokenizer: Any, first_step: int, resumed: TrainerState | None,
              max_steps: int, urls: list[str]) -> RankZeroServices:
        """The rollout controller on its own loop, admission restored to the resumed version and the
        dataset's prompts to the resumed ledger (those pending at the checkpoint come first), the
        progress endpoint, and with ``spec.agent`` the gateway the agent's episodes come through
        (instead of the dataset's, through the run's workflow); curves and evaluations."""
        spec, algo = run.spec, run.spec.algorithm
        manager = StalenessManager(algo.batch_size // algo.group_size, spec.rollout.max_staleness,
                                   max(1, spec.rollout.max_concurrent // algo.group_size))
        manager.restore(first_step)  # admission restarts at version × batch: no burst of stale samples
        position = resumed.data_position if resumed else 0
        check = PromptCheck.of(spec, tokenizer)
        stream = examples(spec.dataset, spec.seed, 0, settings, check.keep, check.dropped)
        check.first_prompt = check.rendered(next(examples(spec.dataset, spec.seed, 0, settings, check.keep)))
        prompts, tasks = None, None
        if spec.agent is None:
            kept = resumed.prompts if resumed and resumed.prompts else {"cursor": position, "pending": []}
            prompts = PromptLedger.restore(kept, stream)
        else:
            tasks = itertools.islice(stream, position, None)
        reward = make_reward(spec)
        workflow = None if spec.agent else make_workflow(
            spec, tokenizer, group_size=algo.group_size, temperature=spec.rollout.temperature,
            max_new_tokens=spec.rollout.max_new_tokens, reward=reward)
        client = InferenceClient(urls, settings.api_token, return_routes=spec.algorithm.routing_replay)
        controller = RolloutController(client, workflow, prompts, manager)
        controller.episodes = position
        controller.start()
        source = pool_source(run, settings)
        if source is not None:
            asyncio.run_coroutine_threadsafe(follow_pool(client, *source), controller.loop)
        server = ProgressServer(Progress(step=first_step, first_step=first_step, version=first_step,
                                         max_steps=max_steps, phase="running"))
        server.start_in(controller.loop, settings.progress_port, settings.bind_host)
        gateway = None
        if spec.agent is not None:
            gateway = Gateway(controller, tokenizer, GatewayConfig(
                model=run.experiment, group_size=algo.group_size, max_new_tokens=spec.rollout.max_new_tokens,
                temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
                session_timeout=spec.agent.session_timeout_seconds, reward=reward),
                settings.agent_token, tasks=tasks)  # agents never hold the pool's token
            gateway.start_in(settings.gateway_port, settings.bind_host)
            server.add_counters("gateway", gateway.summary)  # kuberl_gateway_rejected, … on /metrics
        curves = Curves.for_run(run, settings)
        evaluations = Evaluations(spec, controller, tokenizer, settings, reward, check.keep) \
            if spec.evaluation is not None else None
        return cls(run, settings, controller, server, gateway, curves, evaluations, max_steps, reward, check)

    def data_state(self) -> tuple[int, dict[str, Any] | None]:
        prompts = self.controller.prompt_state()
        return (prompts["cursor"] if prompts else self.controller.episodes), prompts

    def next_batch(self, groups: int, step: int, config: AlgorithmConfig) -> Batch | None:
        """The step's groups from the rollout buffer as a batch; None when the pool is starved. The next
        step's are taken ahead meanwhile (``RolloutController.take``), except after the last step."""
        wait_start = time.perf_counter()
        taken = self.controller.take(groups, step, ahead=step + 1 < self.max_steps)
        if taken is None:
            return None
        trajs, advs, dropped = build_batch(taken, config)
        self._audit(step, taken, trajs)
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
        self._sample_rollout_cpu(tally)
        reward = mean([t.reward for t in trajs]) or 0.0
        tally.rewards.append(reward)
        multi_turn = bool(self.run.spec.rollout.tools or self.run.spec.agent)
        tools = mean([float(t.info.get("tool_calls", 0)) for t in trajs]) if multi_turn else None
        if tools is not None:
            tally.tool_calls.append(tools)
        entropy = stats.get("ppo_actor/entropy") if stats else None
        if entropy is not None and not math.isnan(entropy):
            tally.entropies.append(entropy)
        staleness, prompts = self.controller.observed_staleness, self.controller.prompt_counts()
        self.server.update(step=step + 1, version=step + 1, reward=reward, reward_first10=mean(tally.rewards[:10]),
                           reward_last10=mean(tally.rewards[-10:]), observed_staleness=staleness,
                           tokens_per_second=tally.tokens_per_second, step_seconds=tally.timeperf["step"][-1],
                           weight_sync_seconds=previous_sync, behav_logp_gap=tally.gaps.last,
                           entropy=tally.entropies[-1] if tally.entropies else None,
                           prompts_trained=prompts.get("trained"), prompts_reissued=prompts.get("reissued"),
                           prompts_skipped=prompts.get("skipped"), reward_timeouts=self.reward.timeouts,
                           reward_errors=self.reward.errors, prompts_too_long=len(self.prompt_check.dropped),
                           **self.rollout_pressure(tally))
        gateway = {f"gateway/{k}": v for k, v in self.gateway.summary().items()} if self.gateway else {}
        self.curves.log(step + 1, {
            **(stats or {}), **gateway, "train/reward": reward, "rollout/tool_calls_per_episode": tools,
            "rollout/observed_staleness": staleness, "rollout/trained_tokens_per_second": tally.tokens_per_second,
            **{f"timeperf/{k}": v[-1] for k, v in tally.timeperf.items() if v}})
        if stats is not None:
            gap = tally.gaps.last if tally.gaps.last is not None else math.nan
            log.info("step %d/%d reward %.3f observed staleness %d loss %.4f entropy %.3f gap %.2g wait %.2fs "
                     "sync %.3fs%s", step + 1, self.max_steps, reward, staleness, stats["ppo_actor/loss"],
                     stats["ppo_actor/entropy"], gap, wait_s, previous_sync,
                     "" if tools is None else f" tool calls/episode {tools:.2f}")

    def _sample_rollout_cpu(self, tally: Tally) -> None:
        """The rollout loop thread's CPU seconds since the last report (``timeperf/rollout_cpu``), and the
        wall seconds between the two (``Tally.report_seconds``); nothing where its clock is unknown."""
        wall, cpu = time.perf_counter(), self.controller.cpu_seconds()
        (last_wall, last_cpu), self._last_sample = self._last_sample, (wall, cpu)
        if cpu is not None and last_cpu is not None:
            tally.timeperf["rollout_cpu"].append(cpu - last_cpu)
            tally.report_seconds.append(wall - last_wall)

    def rollout_pressure(self, tally: Tally) -> dict[str, float | int | None]:
        """What an autoscaler reads (``/progress``, ``/metrics``): the share of the last
        :data:`WAIT_STEPS` steps' seconds spent waiting for rollouts (Σ wait ÷ Σ step: one step's share
        swings with an evaluation or a weight update), the groups ready ahead of the trainer, the
        staleness window in use (:attr:`~kuberl.rollout.staleness.StalenessManager.budget_used`; read
        from the rollout loop's thread: a snapshot, not a transaction); and the CPU share the rollout
        loop's thread took of those seconds (it shares the trainer's process, its GIL and, unless the
        pod has cores to spare, the trainer's core)."""
        return {"rollout_wait_fraction": fraction_of_steps(tally.timeperf["wait_rollout"], tally.timeperf["step"]),
                "rollout_cpu_fraction": fraction_of_steps(tally.timeperf["rollout_cpu"], tally.report_seconds),
                "rollout_ready_groups": len(self.controller.buffer),
                "staleness_budget_used": round(self.controller.manager.budget_used, 4)}
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
            self._record(self.evaluations.finished())

    def _record(self, results: list[EvalResult]) -> None:
        for result in results:
            self.server.update(eval_step=result.step, eval_reward=result.reward, eval_pass_at_k=result.pass_at_k)
            self.curves.log(result.step, result.metrics())

    def finish(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any]:
        """After the last step: the last evaluation, the curves closed, the summary and the final progress
        (the termination message the operator reads), then every service stopped. Returns the summary."""
        if self.evaluations is not None:
            self._record(self.evaluations.wait(timeout=EVAL_WAIT_SECONDS))
        self.curves.close()
        log.info("training curves: %s (tensorboard --logdir %s)", self.curves.location, self.curves.location)
        summary = self.summarize(tally, first_step, sft_losses, world)
        self.server.update(phase="succeeded")
        self.server.write_termination_message(self.settings.termination_log)
        if self.gateway is not None:
            self.gateway.stop()
        scorers = [self.reward, *([self.evaluations.reward] if self.evaluations is not None else [])]
        for scorer in dict.fromkeys(scorers):  # their workers, reaped on the loop they were started on
            asyncio.run_coroutine_threadsafe(scorer.aclose(), self.controller.loop).result(timeout=30)
        self.controller.stop()
        return summary

    def summarize(self, tally: Tally, first_step: int, sft_losses: list[float], world: int) -> dict[str, Any]:
        """The run summary (``summary.json``, the termination message's source)."""
        spec, wall, controller = self.run.spec, time.perf_counter() - tally.start, self.controller
        return {
            "steps": tally.steps_done,
            "resumed_from_step": first_step,
            "batch_size": spec.algorithm.batch_size,
            "reward_first10_mean": mean(tally.rewards[:10]),
            "reward_last10_mean": mean(tally.rewards[-10:]),
            "entropy_first10_mean": mean(tally.entropies[:10]),
            "entropy_last10_mean": mean(tally.entropies[-10:]),
            "observed_staleness": controller.observed_staleness,
            "max_token_staleness_trained": tally.token_staleness,
            "final_version": controller.manager.version,  # what every replica confirmed it serves
            **tally.gaps.summary(),
            "wall_seconds": round(wall, 3),
            "trained_tokens_per_second": round(tally.trained_tokens / wall, 1),
            "generated_tokens_per_second": round(controller.generated_tokens / wall, 1),
            "weight_sync_seconds_mean": round(mean(tally.timeperf["weight_sync"]) or 0.0, 4),
            "weight_update_bytes": tally.update_bytes,
            "weight_update_fraction": round(tally.update_bytes / tally.policy_bytes, 5) if tally.policy_bytes else None,
            **{f"timeperf/{k}_mean": round(mean(v) or 0.0, 4) for k, v in tally.timeperf.items()},
            "stale_groups_dropped": controller.buffer.dropped,
            "prompts": prompt_summary(controller.prompt_state()),
            "reward_timeouts": self.reward.timeouts,
            "reward_errors": self.reward.errors,
            "dataset": self.prompt_check.summary(),
            "model": self.model,
            "export": self.export,
            "filtered_groups": tally.dropped_groups,
            "sft_warmup_final_loss": sft_losses[-1] if sft_losses else None,
            "max_staleness": spec.rollout.max_staleness,  # the bound η; observed_staleness stays at or below it
            "world_size": world,
            "trainer": trainer_layout(spec),
            "replicas": len(controller.client.replicas),
            "rewards": [round(r, 4) for r in tally.rewards],
            "entropies": [round(h, 4) for h in tally.entropies],
            "tool_calls_per_episode": [round(x, 3) for x in tally.tool_calls] if tally.tool_calls else None,
            "eval": [{"step": e.step, "version": e.version, "reward": round(e.reward, 4),
                      f"pass@{e.k}": round(e.pass_at_k, 4), "length": round(e.length, 2)}
                     for e in (self.evaluations.history if self.evaluations else [])],
            "tensorboard": self.curves.location,
            "gateway": self.gateway.summary() if self.gateway else None,
        }
