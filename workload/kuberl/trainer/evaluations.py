"""Rank 0's share of ``spec.evaluation``: start a held-out evaluation every N steps on the rollout
loop (never two at once; training does not wait), collect the finished ones for the log, the
progress endpoint, TensorBoard and the summary; and what an evaluation is (``evaluation_parts``),
for the rollout process and ``kuberl eval`` alike."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
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


def evaluation_concurrency(batch_size: int, samples_per_prompt: int) -> int:
    """Groups an evaluation keeps in flight during training: max(1, ⌊B ÷ k⌋), one training batch's
    samples. Rollout keeps up to η + 1 batches in flight, so an evaluation holds at most 1 ÷ (η + 2)
    of the pool's work instead of flooding it (all its prompts at once stalled the trainer for the
    whole evaluation: 0.25–0.33 s at each one in the main example, 9 of its 94 ms per step)."""
    return max(1, batch_size // samples_per_prompt)


class Evaluations:
    def __init__(self, every: int, start: Callable[[int], Future[EvalResult]]):
        """Every ``every`` steps ``start(steps done)`` (the rollout's evaluation after that step, whose
        future holds its result: :meth:`.rollout_side.RolloutSide.start_evaluation`)."""
        self.every, self.start = every, start
        self.history: list[EvalResult] = []
        self._reported = 0
        self._pending: Future[EvalResult] | None = None

    def maybe_start(self, steps_done: int, last: bool = False) -> None:
        """After ``steps_done`` steps: start one if it is due (or ``last``) and none is running."""
        if (steps_done % self.every == 0 or last) and (self._pending is None or self._pending.done()):
            self._collect()
            self._pending = self.start(steps_done)

    def finished(self) -> list[EvalResult]:
        """Results that came in since the last call (never blocks)."""
        if self._pending is not None and self._pending.done():
            self._collect()
        return self._new()

    def wait(self, timeout: float) -> list[EvalResult]:
        """At the end of the run: the running evaluation's result too."""
        if self._pending is not None:
            self._pending.result(timeout)
            self._collect()
        return self._new()

    def _new(self) -> list[EvalResult]:
        new, self._reported = self.history[self._reported:], len(self.history)
        return new

    def _collect(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        result = pending.result()  # an evaluation that failed fails the run, loudly
        self.history.append(result)
        log.info("eval after step %d (version %d): reward %.3f pass@%d %.3f length %.1f (%d prompts, %.1fs)",
                 result.step, result.version, result.reward, result.k, result.pass_at_k, result.length,
                 result.prompts, result.seconds)
