"""Each client's token rate (``kuberl serve --tokens-per-minute``): a token bucket per client.

A client's bucket holds at most ``per_minute`` tokens and refills at ``per_minute / 60`` a second. A request
costing ``c`` tokens (a forward/backward pass: its data's tokens; a sample: the prompt plus ``n × max_tokens``,
the unused part given back when it is done) is admitted when the bucket holds min(c, per_minute) — so one
request larger than a minute's worth is admitted from a full bucket and leaves it in debt — and is charged
c; otherwise nothing is charged and the client is told to retry after (min(c, per_minute) − level) / rate
seconds. One client's heavy use delays only that client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import Busy


@dataclass
class TokenBudget:
    per_minute: int
    clock: Callable[[], float] = time.monotonic
    _levels: dict[str, tuple[float, float]] = field(default_factory=dict)  # client → (level, when)

    @property
    def rate(self) -> float:
        return self.per_minute / 60.0

    def level(self, owner: str) -> float:
        level, when = self._levels.get(owner, (float(self.per_minute), self.clock()))
        return min(float(self.per_minute), level + (self.clock() - when) * self.rate)

    def take(self, owner: str, cost: int) -> None:
        """Charge ``cost`` tokens to ``owner``, or raise Busy saying when to retry (nothing charged)."""
        level, need = self.level(owner), min(cost, self.per_minute)
        if level < need:
            raise Busy(f"{self.per_minute} tokens a minute is your share here; this request needs {cost} and your "
                       f"budget holds {max(level, 0):.0f} now", retry_after=(need - level) / self.rate)
        self._levels[owner] = (level - cost, self.clock())

    def give_back(self, owner: str, tokens: int) -> None:
        """Return reserved tokens that were not used (a sample that stopped early)."""
        self._levels[owner] = (min(float(self.per_minute), self.level(owner) + tokens), self.clock())
