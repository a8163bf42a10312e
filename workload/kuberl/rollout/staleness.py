"""Bounded-staleness admission control for asynchronous rollout (AReaL's StalenessManager).

With η = ``max_staleness``, B = ``batch_size`` (trajectories per training step) and v = the current
policy version, a new rollout may start only while

    accepted + running < (η + v + 1) · B      and      running < max_concurrent.

Trajectories are consumed B per step in order of acceptance, so a rollout admitted under version v
holds one of the first (η + v + 1)·B positions and is trained at a version ≤ v + η: its staleness
is at most η. η = 0 is synchronous RL (only the batch for version v is ever generated). After a
restart from version v, ``accepted`` restarts at v·B so no burst of stale samples is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_staleness < 0 or self.max_concurrent < 1:
            raise ValueError("batch_size ≥ 1, max_staleness ≥ 0 and max_concurrent ≥ 1 are required")
        if self.accepted == 0:
            self.accepted = self.version * self.batch_size

    @property
    def capacity(self) -> int:
        """How many more rollouts may start right now."""
        by_staleness = (self.max_staleness + self.version + 1) * self.batch_size - self.accepted - self.running
        return max(0, min(by_staleness, self.max_concurrent - self.running))

    @property
    def budget_used(self) -> float:
        """The share of the staleness window in use: (accepted + running − v·B) ÷ ((η + 1)·B). 1: generation
        is as far ahead of the trainer as η allows and admission waits (rollout capacity to spare);
        near 0: nothing is ready ahead of the trainer (it waits for rollouts)."""
        window = (self.max_staleness + 1) * self.batch_size
        return max(0.0, (self.accepted + self.running - self.version * self.batch_size) / window)

    def try_start(self) -> bool:
        """Reserve a slot for one rollout; False when admission must wait."""
        if self.capacity <= 0:
            return False
        self.running += 1
        return True

    def finish(self, accepted: bool) -> None:
        """A rollout ended; ``accepted`` if its trajectory went into the buffer."""
        if self.running <= 0:
            raise RuntimeError("finish() without a matching try_start()")
        self.running -= 1
        if accepted:
            self.accepted += 1

    def drop_accepted(self) -> None:
        """An accepted rollout was dropped before training (too stale): its slot reopens."""
        if self.accepted <= 0:
            raise RuntimeError("drop_accepted() without an accepted rollout")
        self.accepted -= 1

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} → {version}")
        self.version = version

    def restore(self, version: int) -> None:
        """Resume after recovery at ``version``: nothing running, accepted = version·B."""
        self.version, self.running, self.accepted = version, 0, version * self.batch_size
