"""The pool autoscaler (``spec.inference.autoscale``): a pure rule from the trainer's wait for rollouts
to a replica count — one rule for both places that apply it: the operator's progress poller
(``kuberl_operator.progress.poll_once``, through the scale subresource) and ``kuberl run``'s
supervisor (``kuberl.local``, through its pool), each when it reads a new step.

With w the trainer's wait fraction (``status.progress.rolloutWaitFraction``: seconds waited for
batches ÷ seconds of its last 10 steps, ``kuberl.trainer.services.WAIT_STEPS``; none before), t the
target, n the replicas now, [lo, hi] the bounds and f the most replicas found too few (the count the
last scale-up left, ``status.autoscale.tooFew``):

- n < lo or n > hi → the nearest bound (a spec edit moved them);
- w > t and n < hi → n + 1 (rollouts are the bottleneck), and f = n;
- w < t / 2 and n > lo → n − 1 (the trainer hardly waits: a replica may be spare), unless n − 1 ≤ f
  and the last change is less than :data:`RECALL_WINDOWS` windows old;
- otherwise n.

The trainer's wait says when a pool is too small, never by how much it is too big: a pool where n
replicas left the trainer waiting 4 % and n − 1 left it waiting 45 % went n → n − 1 → n every window
on the wait rule alone (measured: ``benchmarks/autoscale.py``). Remembering the count that was too
few keeps it at n; the memory fades after :data:`RECALL_WINDOWS` windows, since the need changes as
the policy learns (answers grow or shrink). One change per window (``windowSeconds``, counted from the
last change the status records) lets a new replica join and its effect show in the wait before the
next decision. A step at a time, not proportional: a pool's throughput is not linear in its
replicas, and the trainer's wait says only which way to go.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import AutoscaleSpec

RECALL_WINDOWS = 6  # a count found too few is not returned to for this many windows


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    too_few: int | None = None  # f after the change (``status.autoscale.tooFew``)


def decide(replicas: int, wait_fraction: float | None, spec: AutoscaleSpec, seconds_since_last: float | None,
           too_few: int | None = None) -> Decision | None:
    """The new replica count, or None to stay (``spec``: ``spec.inference.autoscale``, its defaults its own;
    ``seconds_since_last``: since the last change, None if there was none; ``too_few``: f, None if none)."""
    low, high = spec.min_replicas, spec.max_replicas
    target, window = spec.target_wait_fraction, spec.window_seconds
    if replicas < low or replicas > high:
        bound = low if replicas < low else high
        return Decision(bound, f"{replicas} replicas are outside [{low}, {high}]", too_few)
    if wait_fraction is None or (seconds_since_last is not None and seconds_since_last < window):
        return None
    waited = f"the trainer waited {wait_fraction:.0%} of its steps for rollouts"
    if wait_fraction > target and replicas < high:
        return Decision(replicas + 1, f"{waited} (target {target:.0%})", too_few=replicas)
    if wait_fraction < target / 2 and replicas > low:
        fresh = seconds_since_last is None or seconds_since_last < RECALL_WINDOWS * window
        remembered = too_few if fresh else None
        if remembered is not None and replicas - 1 <= remembered:
            return None
        return Decision(replicas - 1, f"{waited} (under half the target {target:.0%})", remembered)
    return None
