"""Accepted trajectories waiting for the trainer, with the staleness bound enforced at batch time.

Admission (``StalenessManager``) keeps accepted + running ≤ (η + v + 1)·B, which bounds staleness
when rollouts finish in the order they started. Rollouts that finish out of order (a long one
overtaken by many short ones) can still be older than η by the time they are trained, so
``take_batch`` checks every sample: staleness = training version − oldest token version, and a
sample with staleness > η is dropped (``dropped`` counts them; the manager is told so admission
reopens its slot). Nothing staler than η is ever trained on.
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
    items: deque[T] = field(default_factory=deque)
    dropped: int = 0
    on_drop: Callable[[T], None] | None = None  # told of each item dropped as too stale

    def _drop(self, item: T) -> None:
        self.dropped += 1
        self.manager.drop_accepted()  # the slot it held reopens for a fresh rollout
        if self.on_drop is not None:
            self.on_drop(item)

    def put(self, item: T) -> None:
        self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def take_batch(self, size: int, version: int) -> list[T] | None:
        """``size`` items fresh enough for training at ``version``, or None if not enough yet."""
        while self.items and version - self.items[0].oldest_version > self.manager.max_staleness:
            self._drop(self.items.popleft())
        fresh = [i for i in self.items if version - i.oldest_version <= self.manager.max_staleness]
        if len(fresh) < size:
            return None
        batch = fresh[:size]
        keep = set(map(id, batch))
        stale = [i for i in self.items if id(i) not in keep and version - i.oldest_version > self.manager.max_staleness]
        for item in stale:
            self.items.remove(item)
            self._drop(item)
        for item in batch:
            self.items.remove(item)
        return batch
