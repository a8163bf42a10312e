"""The weight exchanges of a run as rank 0 accounted for them (:class:`~kuberl.api.progress.WeightPush`): the
last one and the counts that ``status.progress`` carries (the operator posts an Event when one grows), and the
summary's ``weight_pushes``."""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..api.progress import SLOW_REPLICA_FACTOR, WeightPush

log = logging.getLogger("kuberl.trainer")


@dataclass
class PushTally:
    """Every push accounted for so far: by the way it went, how many fell back to broadcast, how many had a
    replica ≥ ``SLOW_REPLICA_FACTOR`` × the median of the others, how many replicas left on the way."""

    by_mode: Counter[str] = field(default_factory=Counter)
    fell_back: int = 0
    slow_replica: int = 0
    replicas_lost: int = 0
    rates: list[float] = field(default_factory=list)  # GB/s of each push that had a measurable time
    last: WeightPush | None = None

    def add(self, push: WeightPush | None) -> None:
        """Count ``push`` (None: nothing was accounted for, e.g. on a rank other than 0); a slow replica is logged."""
        if push is None:
            return
        self.by_mode[push.mode] += 1
        self.fell_back += push.fell_back
        self.replicas_lost += push.replicas_lost
        if push.gigabytes_per_second is not None:
            self.rates.append(push.gigabytes_per_second)
        if push.slow_replica:
            self.slow_replica += 1
            log.warning("weight push of version %d: replica %s took %.1f× the median of the %d that took it "
                        "(%.3f s)", push.version, push.slowest_replica, push.slowest_ratio, push.replicas,
                        push.seconds)
        self.last = push

    def progress(self) -> dict[str, Any]:
        """The ``Progress`` fields of the pushes so far."""
        return {"last_push": self.last, "pushes_fell_back": self.fell_back, "pushes_slow_replica": self.slow_replica}

    def summary(self) -> dict[str, Any]:
        """The summary's ``weight_pushes``: counts, the median rate, the last push's account (camelCase)."""
        return {"by_mode": dict(self.by_mode), "fell_back": self.fell_back, "slow_replica": self.slow_replica,
                "slow_replica_factor": SLOW_REPLICA_FACTOR, "replicas_lost": self.replicas_lost,
                "gigabytes_per_second_median": round(statistics.median(self.rates), 4) if self.rates else None,
                "last": self.last.to_wire() if self.last is not None else None}
