"""Which episodes training sees: the lengths (output tokens) of the episodes generated, trained and
dropped as too stale, kept as counts per length (bounded by ``maxNewTokens`` distinct values).

Long episodes are the ones that go stale, so a rollout that drops stale groups trains on shorter ones
than it generates; ``ks_distance(generated, trained)`` — the largest gap between the two cumulative
distributions, 0 when training sees what rollout makes — says how much.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .types import Trajectory


def quantile(counts: Counter[int], q: float) -> float | None:
    """The smallest length with at least a share ``q`` of the episodes at or below it; None when empty."""
    total = sum(counts.values())
    if total == 0:
        return None
    seen = 0
    for length in sorted(counts):
        seen += counts[length]
        if seen >= q * total:
            return float(length)
    return float(max(counts))


def ks_distance(a: Counter[int], b: Counter[int]) -> float | None:
    """max over x of |F_a(x) − F_b(x)| (the two-sample Kolmogorov–Smirnov statistic); None if either is empty."""
    total_a, total_b = sum(a.values()), sum(b.values())
    if total_a == 0 or total_b == 0:
        return None
    cdf_a = cdf_b = worst = 0.0
    for length in sorted(set(a) | set(b)):
        cdf_a += a[length] / total_a
        cdf_b += b[length] / total_b
        worst = max(worst, abs(cdf_a - cdf_b))
    return round(worst, 4)


def described(counts: Counter[int]) -> dict[str, float | int | None]:
    """n, mean, p50 and p90 of the lengths in ``counts``."""
    total = sum(counts.values())
    mean = sum(length * n for length, n in counts.items()) / total if total else None
    return {"n": total, "mean": None if mean is None else round(mean, 2), "p50": quantile(counts, 0.5),
            "p90": quantile(counts, 0.9)}


@dataclass
class EpisodeLengths:
    """Counts per output length of the episodes generated, trained and dropped (the rollout loop adds;
    other threads read :meth:`report`, which copies each count first)."""

    generated: Counter[int] = field(default_factory=Counter)
    trained: Counter[int] = field(default_factory=Counter)
    dropped: Counter[int] = field(default_factory=Counter)

    @staticmethod
    def add(counts: Counter[int], trajectories: Iterable[Trajectory]) -> None:
        counts.update(len(t.output_ids) for t in trajectories)

    def report(self) -> dict[str, object]:
        """Each kind :func:`described`, and ``ks_generated_trained``."""
        generated, trained, dropped = (Counter(dict.copy(c)) for c in (self.generated, self.trained, self.dropped))
        return {"generated": described(generated), "trained": described(trained), "dropped": described(dropped),
                "ks_generated_trained": ks_distance(generated, trained)}
