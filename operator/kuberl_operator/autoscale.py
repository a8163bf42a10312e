"""The pool autoscaler (``spec.inference.autoscale``): a pure rule from the trainer's wait for rollouts
to a replica count, applied by the progress poller (``progress.poll_once``) when it reads a step.

With w the trainer's wait fraction (``status.progress.rolloutWaitFraction``: seconds waited for the
step's batch ÷ the step's seconds), t the target, n the replicas now and [lo, hi] the bounds:

- n < lo or n > hi → the nearest bound (a spec edit moved them);
- w > t and n < hi → n + 1 (rollouts are the bottleneck);
- w < t / 2 and n > lo → n − 1 (the trainer hardly waits: a replica is spare);
- otherwise n.

Hysteresis (the band [t/2, t]) and one change per window (``windowSeconds``, counted from the last
change the status records) keep it from flapping: a new replica joins and its effect shows in the
wait before the next decision. A step at a time, not proportional: a pool's throughput is not
linear in its replicas, and the trainer's wait says only which way to go.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def decide(replicas: int, wait_fraction: float | None, spec: dict[str, Any], seconds_since_last: float | None
           ) -> Decision | None:
    """The new replica count, or None to stay (``spec``: ``spec.inference.autoscale`` in wire form;
    ``seconds_since_last``: since the last change, None if there was none)."""
    low, high = int(spec.get("minReplicas", 1)), int(spec["maxReplicas"])
    target, window = float(spec.get("targetWaitFraction", 0.1)), float(spec.get("windowSeconds", 300))
    if replicas < low or replicas > high:
        bound = low if replicas < low else high
        return Decision(bound, f"{replicas} replicas are outside [{low}, {high}]")
    if wait_fraction is None or (seconds_since_last is not None and seconds_since_last < window):
        return None
    if wait_fraction > target and replicas < high:
        return Decision(replicas + 1, f"the trainer waited {wait_fraction:.0%} of its step for rollouts "
                                      f"(target {target:.0%})")
    if wait_fraction < target / 2 and replicas > low:
        return Decision(replicas - 1, f"the trainer waited {wait_fraction:.0%} of its step for rollouts "
                                      f"(under half the target {target:.0%})")
    return None


def seconds_between(earlier: str | None, now: datetime) -> float | None:
    """Seconds from an RFC 3339 time (as the status records it) to ``now``; None without one."""
    if not earlier:
        return None
    try:
        return (now - datetime.fromisoformat(earlier.replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return None
