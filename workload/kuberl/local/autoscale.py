"""``spec.inference.autoscale`` in ``kuberl run``: the operator's rule (:func:`kuberl.api.autoscale.decide`)
applied to trainer rank 0's progress once per new step; the supervisor carries a decision out through
its pool as ``kuberl scale`` does. Each change is also one JSON line in the work dir's
``autoscale.jsonl`` — what ``status.autoscale`` and the ``Autoscaled`` Event are on a cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..api import Progress
from ..api.autoscale import Decision, decide
from ..api.spec import AutoscaleSpec, RLExperimentSpec

TRACE_FILE = "autoscale.jsonl"


@dataclass
class LocalAutoscaler:
    spec: AutoscaleSpec  # spec.inference.autoscale
    trace: Path
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    _step: int | None = field(default=None, init=False)
    _changed_at: float | None = field(default=None, init=False)
    _too_few: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    @classmethod
    def of(cls, spec: RLExperimentSpec, work: Path) -> LocalAutoscaler | None:
        """The run's autoscaler, None without ``spec.inference.autoscale``."""
        autoscale = spec.inference.autoscale
        return None if autoscale is None else cls(autoscale, work / TRACE_FILE)

    def observe(self, replicas: int, progress: Progress | None) -> Decision | None:
        """A change of the pool's ``replicas``, decided on a step not seen before; None to stay."""
        if progress is None or progress.step is None or progress.step == self._step:
            return None
        self._step = progress.step
        now = self.clock()
        since = None if self._changed_at is None else now - self._changed_at
        decision = decide(replicas, progress.rollout_wait_fraction, self.spec, since, self._too_few)
        if decision is None or decision.replicas == replicas:
            return None
        self._changed_at, self._too_few = now, decision.too_few
        line = {"step": progress.step, "seconds": round(now - self.started, 2), "from": replicas,
                "to": decision.replicas, "waitFraction": progress.rollout_wait_fraction,
                "tooFew": decision.too_few, "reason": decision.reason}
        with self.trace.open("a") as out:
            out.write(json.dumps(line) + "\n")
        return decision
