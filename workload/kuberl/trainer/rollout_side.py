"""What trainer rank 0's rollout process runs (:mod:`.rollout_process` starts it and talks to it).

``RolloutSide`` is built from a ``RolloutRecipe`` — the run, the settings, the tokenizer and where
the resumed run stands — and holds everything that drives the inference pool: the rollout controller
(its event loop on a thread of this process), the prompt ledger and the dataset stream, the reward
scorer, the pool follower, the agent gateway (with ``spec.agent``) and the held-out evaluations'
episodes. The trainer calls its methods through :mod:`kuberl.ipc`; ``RolloutSnapshot`` is what it
reads at every step's report. Nothing here touches the policy: the trainer process keeps the model,
the weight exchange's sends, the progress endpoint and the curves.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .. import tracing
from ..api.progress import PoolReceipt
from ..api.rollout import LateGroups
from ..data.datasets import Example, examples
from ..gateway.server import Gateway, GatewayConfig
from ..inference.contract import ReplyLimits
from ..interpreter import freeze_set_up_heap
from ..rewards.pool import Scorer
from ..rollout.client import InferenceClient, WeightPayload
from ..rollout.controller import RolloutController
from ..rollout.evaluation import EvalResult
from ..rollout.ledger import PromptLedger
from ..rollout.staleness import StalenessManager
from ..rollout.types import Group
from ..runconfig import RunConfig
from ..settings import Settings
from .evaluations import evaluation_parts
from .pool import follow_pool, pool_source
from .workflows import PromptCheck, make_reward, make_workflow

log = logging.getLogger("kuberl.rollout")
INLINE = ("snapshot", "p2p_membership_changed")  # answered at once, never behind a blocked call (kuberl.ipc)


@dataclass(frozen=True)
class RolloutRecipe:
    """What the rollout process builds itself from: the run, its settings and tokenizer, the step it
    starts at, the dataset position and prompt ledger a resumed run restores (None: a fresh ledger at
    ``position``), and the replicas' URLs."""

    run: RunConfig
    settings: Settings
    tokenizer: Any
    first_step: int
    position: int
    prompts: dict[str, Any] | None
    urls: list[str]
    limits: ReplyLimits  # what the replicas' replies may hold for this model


@dataclass(frozen=True)
class RolloutSnapshot:
    """The rollout's numbers as of one moment (each read on its own: a snapshot, not a transaction)."""

    observed_staleness: int
    prompt_counts: dict[str, int]  # trained / reissued / skipped ({}: episodes come from the gateway)
    ready_groups: int  # in the buffer, ahead of the trainer
    budget_used: float  # StalenessManager.budget_used
    cpu_seconds: float  # this process's CPU time so far (every thread: episodes, HTTP, rewards, gateway)
    generated_tokens: int
    version: int  # what every replica confirmed it serves
    stale_groups_dropped: int  # staler than η, with lateGroups: drop
    late_groups_trained: int  # staler than η, trained with their importance weights (lateGroups: train)
    replicas: int
    reward_timeouts: int
    reward_errors: int
    prompts_too_long: int
    gateway: dict[str, int] | None
    episode_lengths: dict[str, Any]  # generated / trained / dropped: n, mean, p50, p90; ks_generated_trained


def prompt_sources(recipe: RolloutRecipe, check: PromptCheck) -> tuple[PromptLedger | None, Iterator[Example] | None]:
    """Where episodes come from: the dataset's prompts through the prompt ledger, restored where the
    resumed run left it (those pending at its checkpoint first); or, with ``spec.agent``, the tasks
    the gateway hands agents, from the resumed position. Rows ``check`` refuses are skipped (counted)."""
    spec, settings = recipe.run.spec, recipe.settings
    stream = examples(spec.dataset, spec.seed, 0, settings, check.keep, check.dropped)
    check.first_prompt = check.rendered(next(examples(spec.dataset, spec.seed, 0, settings, check.keep)))
    if spec.agent is not None:
        return None, itertools.islice(stream, recipe.position, None)
    return PromptLedger.restore(recipe.prompts or {"cursor": recipe.position, "pending": []}, stream), None


def start_gateway(recipe: RolloutRecipe, controller: RolloutController, reward: Scorer,
                  tasks: Iterator[Example] | None) -> Gateway:
    """``spec.agent``'s OpenAI-compatible gateway, serving on the controller's loop."""
    run, settings, algo, rollout = recipe.run, recipe.settings, recipe.run.spec.algorithm, recipe.run.spec.rollout
    assert run.spec.agent is not None
    gateway = Gateway(controller, recipe.tokenizer, GatewayConfig(
        model=run.experiment, group_size=algo.group_size, max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature, top_p=rollout.top_p, session_timeout=run.spec.agent.session_timeout_seconds,
        reward=reward), settings.agent_token, tasks=tasks)  # agents never hold the pool's token
    gateway.start_in(settings.gateway_port, settings.bind_host)
    return gateway


class RolloutSide:
    def __init__(self, recipe: RolloutRecipe):
        """The controller on its own loop, admission restored to the resumed version, its episodes from
        ``prompt_sources``; the pool follower; with ``spec.agent`` the gateway; the evaluation's episodes."""
        run, settings, tokenizer = recipe.run, recipe.settings, recipe.tokenizer
        spec, algo = run.spec, run.spec.algorithm
        tracing.set_up(spec.observability, settings, "kuberl-rollout")
        manager = StalenessManager(algo.batch_size // algo.group_size, spec.rollout.max_staleness,
                                   max(1, spec.rollout.max_concurrent // algo.group_size))
        manager.restore(recipe.first_step)  # admission restarts at version × batch: no burst of stale samples
        self.check = PromptCheck.of(spec, tokenizer)
        prompts, tasks = prompt_sources(recipe, self.check)
        self.reward = make_reward(spec)
        workflow = None if spec.agent else make_workflow(
            spec, tokenizer, group_size=algo.group_size, temperature=spec.rollout.temperature,
            max_new_tokens=spec.rollout.max_new_tokens, reward=self.reward)
        client = InferenceClient(recipe.urls, settings.api_token, return_routes=spec.algorithm.routing_replay,
                                 limits=recipe.limits, push_timeout=spec.weight_sync.timeout_seconds)
        self.controller = RolloutController(client, workflow, prompts, manager,
                                            drop_stale=spec.rollout.late_groups == LateGroups.DROP)
        self.controller.episodes = recipe.position
        self.controller.start()
        if (source := pool_source(run, settings)) is not None:
            asyncio.run_coroutine_threadsafe(follow_pool(client, *source), self.controller.loop)
        self.gateway = start_gateway(recipe, self.controller, self.reward, tasks) if spec.agent else None
        self.evaluation, self.eval_k = None, 0
        if (ev := spec.evaluation) is not None:
            self.evaluation = evaluation_parts(spec, ev, tokenizer, settings, self.check.keep, self.reward)
            self.eval_k = ev.samples_per_prompt
            log.info("evaluation: %d prompts × %d samples every %d steps", len(self.evaluation[0]), self.eval_k,
                     ev.every_steps)

    def take(self, groups: int, version: int, ahead: bool) -> list[Group] | None:
        """:meth:`RolloutController.take`."""
        return self.controller.take(groups, version, ahead)

    def snapshot(self) -> RolloutSnapshot:
        c = self.controller
        return RolloutSnapshot(
            observed_staleness=c.observed_staleness, prompt_counts=c.prompt_counts(), ready_groups=len(c.buffer),
            budget_used=c.manager.budget_used, cpu_seconds=time.process_time(), generated_tokens=c.generated_tokens,
            version=c.manager.version, stale_groups_dropped=c.buffer.dropped,
            late_groups_trained=c.buffer.late, replicas=len(c.client.replicas),
            reward_timeouts=self.reward.timeouts, reward_errors=self.reward.errors,
            prompts_too_long=len(self.check.dropped), gateway=self.gateway.summary() if self.gateway else None,
            episode_lengths=c.lengths.report())

    def data_state(self) -> tuple[int, dict[str, Any] | None]:
        """What a checkpoint keeps of the data: the position in the stream and the prompt ledger's
        state (``PromptLedger.state``, a consistent cut; None when episodes come from the gateway)."""
        prompts = self.controller.prompt_state()
        return (prompts["cursor"] if prompts else self.controller.episodes), prompts

    def dataset(self) -> dict[str, Any]:
        """The summary's ``dataset``: what was done to the prompts (``PromptCheck.summary``)."""
        return self.check.summary()

    def update_weights(self, payload: WeightPayload, version: int) -> Future[PoolReceipt]:
        return self.controller.update_weights(payload, version)

    def receive_p2p(self, version: int, relayed: bool = False) -> Future[PoolReceipt]:
        return self.controller.receive_p2p(version, relayed)

    def join_p2p(self, bodies: list[dict[str, Any]]) -> None:
        self.controller.join_p2p(bodies)

    def replica_topologies(self) -> list[dict[str, str]]:
        return self.controller.replica_topologies()

    def p2p_membership_changed(self) -> bool:
        return self.controller.p2p_membership_changed()

    def start_evaluation(self, step: int) -> Future[EvalResult]:
        """The held-out evaluation after ``step`` steps, on the rollout loop next to rollout."""
        if self.evaluation is None:
            raise RuntimeError("spec.evaluation is not set: there is no evaluation to start")
        examples_, workflow, _ = self.evaluation
        return self.controller.start_evaluation(examples_, workflow, self.eval_k, step)

    def stop(self) -> None:
        """The gateway, the reward workers (reaped on the loop they were started on), then the loop."""
        if self.gateway is not None:
            self.gateway.stop()
        scorers = [self.reward, *([self.evaluation[2]] if self.evaluation is not None else [])]
        for scorer in dict.fromkeys(scorers):
            asyncio.run_coroutine_threadsafe(scorer.aclose(), self.controller.loop).result(timeout=30)
        self.controller.stop()
        tracing.shut_down()


class RolloutHost:
    """What the rollout process serves: ``build(recipe)`` first, then ``RolloutSide``'s methods (any
    other name asked before the build fails, naming it)."""

    def __init__(self) -> None:
        self.side: RolloutSide | None = None

    def build(self, recipe: RolloutRecipe) -> None:
        self.side = RolloutSide(recipe)
        freeze_set_up_heap()  # as the trainer's: a full collection of torch's and transformers' objects stalls

    def __getattr__(self, name: str) -> Any:
        side = self.__dict__.get("side")
        if side is None:
            raise RuntimeError(f"the rollout process was asked for {name!r} before it was built")
        return getattr(side, name)
