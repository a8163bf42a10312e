"""Accepted trajectories waiting for the trainer, handed out oldest first.

Admission (``StalenessManager``) keeps accepted + running ≤ (η + v + 1)·B, which bounds staleness
(training version − oldest token version) by η when rollouts finish in the order they started. One
that finishes out of order — a long episode overtaken by many short ones — can be *late*: staler than
η by the time it is trained. What happens to it is ``drop_stale``'s choice (``spec.rollout.lateGroups``):

- False (``train``, the default, AReaL's rule): it is trained with the others, its tokens corrected by
  the decoupled loss's behaviour importance weight π_prox / π_behav (masked or truncated at
  ``algorithm.behaviorImpCap``); ``late`` counts such groups. Nothing is lost, so training sees the
  episodes rollout makes, long ones included.
- True (``drop``): it is dropped (``dropped`` counts them; the manager is told so admission reopens
  its slot, and ``on_drop`` gives its prompt back). Nothing staler than η is ever trained on, at the
  price of a bias toward short episodes when lengths are long-tailed (``benchmarks/long_tail.py``).

Batches take the oldest groups first (by oldest token version, ties in arrival order), so a late
group is trained at the first step after it arrives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .staleness import StalenessManager
from .types import Versioned

T = TypeVar("T", bound=Versioned)


@dataclass
class RolloutBuffer(Generic[T]):
    manager: StalenessManager
    drop_stale: bool = False
    items: deque[T] = field(default_factory=deque)
    dropped: int = 0  # groups dropped as staler than η (drop_stale)
    late: int = 0  # groups trained staler than η (not drop_stale)
    on_drop: Callable[[T], None] | None = None  # told of each item dropped as too stale

    def put(self, item: T) -> None:
        self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def _is_stale(self, item: T, version: int) -> bool:
        return version - item.oldest_version > self.manager.max_staleness

    def _drop_stale(self, version: int) -> None:
        stale = [item for item in self.items if self._is_stale(item, version)]
        for item in stale:
            self.items.remove(item)
            self.dropped += 1
            self.manager.drop_accepted()  # the slot it held reopens for a fresh rollout
            if self.on_drop is not None:
                self.on_drop(item)

    def take_batch(self, size: int, version: int) -> list[T] | None:
        """The ``size`` oldest items for training at ``version``, or None if not enough yet."""
        if self.drop_stale:
            self._drop_stale(version)
        if len(self.items) < size:
            return None
        batch = sorted(self.items, key=lambda item: item.oldest_version)[:size]  # stable: ties keep arrival order
        taken = set(map(id, batch))
        self.items = deque(item for item in self.items if id(item) not in taken)
        self.late += sum(self._is_stale(item, version) for item in batch)
        return batch
