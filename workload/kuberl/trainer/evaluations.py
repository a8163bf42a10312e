"""Rank 0's share of ``spec.evaluation``: start a held-out evaluation every N steps on the rollout
loop (never two at once), hold the next weight update until it is done so that one policy version
writes it, collect the finished ones for the log, the progress endpoint, TensorBoard and the summary;
and what an evaluation is (``evaluation_parts``), for the rollout process and ``kuberl eval`` alike."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from ..api.spec import EvaluationSpec, RLExperimentSpec
from ..data.datasets import Example, Keep, evaluation_examples
from ..rewards.pool import Scorer
from ..rollout.evaluation import EvalResult
from ..rollout.workflow import RolloutWorkflow
from ..settings import Settings
from .workflows import make_reward, make_workflow

log = logging.getLogger("kuberl.trainer")


def evaluation_sampling(spec: RLExperimentSpec, ev: EvaluationSpec) -> tuple[float, int]:
    """(temperature, max new tokens) of an evaluation: ``ev``'s own, else the rollout's."""
    return (spec.rollout.temperature if ev.temperature is None else ev.temperature,
            ev.max_new_tokens or spec.rollout.max_new_tokens)


def evaluation_parts(spec: RLExperimentSpec, ev: EvaluationSpec, tokenizer: Any, settings: Settings,
                     keep: Keep | None, run_reward: Scorer | None) -> tuple[list[Example], RolloutWorkflow, Scorer]:
    """What an evaluation ``ev`` of ``spec``'s run is — the same during training and in ``kuberl eval``:
    its examples (``ev.dataset``, else the run's under another seed; ``keep``: the run's prompt filter),
    the run's own episodes (with its tools) at ``ev``'s sampling, and its scorer — ``ev.reward``'s when
    it names another function than the run's, else ``run_reward`` (made here when None)."""
    examples = evaluation_examples(ev.dataset or spec.dataset, ev.prompts, spec.seed, settings, keep)
    if ev.reward is not None and ev.reward.function != spec.reward.function:
        reward = make_reward(spec, ev.reward.function, "spec.evaluation.reward.function")
    else:
        reward = run_reward or make_reward(spec)
    temperature, max_new_tokens = evaluation_sampling(spec, ev)
    workflow = make_workflow(spec, tokenizer, group_size=ev.samples_per_prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, reward=reward)
    return examples, workflow, reward


class Evaluations:
    """The schedule: the evaluation due after step N starts then (on the rollout loop, every prompt at
    once, once the replicas serve version N) and the weight update of version N + 1 waits for it
    (:meth:`hold`), so version N alone writes it and it is recorded after step N + 1. An evaluation
    still running when the next is due (possible only past :attr:`hold_seconds`) makes that one be
    skipped, said in the log and in :attr:`skipped`."""

    def __init__(self, every: int, start: Callable[[int], Future[EvalResult]], hold_seconds: float):
        """Every ``every`` steps ``start(steps done)`` (the rollout's evaluation after that step, whose
        future holds its result: :meth:`.rollout_side.RolloutSide.start_evaluation`); a weight update
        waits at most ``hold_seconds`` for it."""
        self.every, self.start, self.hold_seconds = every, start, hold_seconds
        self.history: list[EvalResult] = []
        self.reported_after: dict[int, int] = {}  # the step an evaluation was due after → steps done when recorded
        self.skipped: list[int] = []  # the steps whose evaluation was skipped
        self._reported = 0
        self._pending: tuple[int, Future[EvalResult]] | None = None  # (due after step, its result)

    def maybe_start(self, steps_done: int, last: bool = False) -> None:
        """After ``steps_done`` steps: start one if it is due (or ``last``); skip it, loudly, while one runs."""
        if steps_done % self.every != 0 and not last:
            return
        if self._pending is not None and not self._pending[1].done():
            log.warning("the evaluation due after step %d is skipped: the one due after step %d is still running",
                        steps_done, self._pending[0])
            self.skipped.append(steps_done)
            return
        self._collect(steps_done)
        self._pending = steps_done, self.start(steps_done)

    def hold(self, version: int) -> None:
        """Before the weight update of ``version``: wait (at most :attr:`hold_seconds`) for the running
        evaluation of an older version to finish, so that one policy writes it. Past that, the update
        goes on — the evaluation's version span says what it measured — and the log says so."""
        if self._pending is None or self._pending[0] >= version:
            return
        due, future = self._pending
        if not wait([future], timeout=self.hold_seconds).not_done:
            return
        log.warning("the evaluation due after step %d has run %.0f s; weight version %d goes out anyway, so it will "
                    "measure more than one version (its version span says how many)", due, self.hold_seconds, version)

    def finished(self, steps_done: int) -> list[EvalResult]:
        """Results that came in since the last call, recorded as of ``steps_done`` steps (never blocks)."""
        if self._pending is not None and self._pending[1].done():
            self._collect(steps_done)
        return self._new()

    def wait(self, timeout: float, steps_done: int) -> list[EvalResult]:
        """At the end of the run: the running evaluation's result too."""
        if self._pending is not None:
            self._pending[1].result(timeout)
            self._collect(steps_done)
        return self._new()

    def _new(self) -> list[EvalResult]:
        new, self._reported = self.history[self._reported:], len(self.history)
        return new

    def _collect(self, steps_done: int) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        result = pending[1].result()  # an evaluation that failed fails the run, loudly
        self.history.append(result)
        self.reported_after[result.step] = steps_done
        log.info("eval after step %d (version %s): reward %.3f pass@%d %.3f length %.1f (%d prompts, %.1fs)",
                 result.step, version_range(result), result.reward, result.k, result.pass_at_k, result.length,
                 result.prompts, result.seconds)


def version_range(result: EvalResult) -> str:
    """``7``, or ``7–8`` when two versions wrote its tokens."""
    return str(result.version) if result.version_span == 1 else f"{result.version}–{result.newest_version}"
