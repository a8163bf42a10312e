"""Which dataset prompts were trained: every prompt of the stream is trained exactly once, across stale
drops, failed episodes and crashes.

Prompts are numbered by their position in the run's deterministic stream (``kuberl.data.datasets.
examples``). A prompt handed out is *pending* until the step that trains its group takes it; a group
dropped as too stale, or an episode that failed, gives its prompt back and it is handed out again
before any new one (*reissued*). A prompt whose episode failed ``MAX_FAILURES`` times is *skipped*,
with a warning (a prompt that breaks its episode is not retried forever); a stale drop is no fault of
the prompt's — its group waited in the buffer while training moved on — so only ``MAX_STALE_DROPS``
of them skip it (one whose episodes always take longer than η steps). A
checkpoint after step s holds the ledger as of step s: the cursor (the next new prompt) and the
pending prompts. Resuming there re-issues those pending prompts — the ones that were in flight or in
the buffer when the checkpoint was taken — before new ones, so none is skipped and none that step s
had trained is trained again. Invariant: ``trained + skipped + len(pending) == cursor``.

Counters change only through the methods (AReaL's ``staleness_manager`` is the model).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..data.datasets import Example

log = logging.getLogger("kuberl.rollout")
MAX_FAILURES = 3  # a prompt whose episode fails this often is skipped, not retried forever
MAX_STALE_DROPS = 20  # … or whose group is dropped as too stale this often (chance alone: ≈ never)


@dataclass
class PromptLedger:
    stream: Iterator[Example]  # the stream, positioned at ``cursor``
    cursor: int = 0
    trained: int = 0
    reissued: int = 0
    skipped: int = 0
    _pending: dict[int, Example] = field(default_factory=dict)  # handed out (or waiting to be again)
    _again: deque[int] = field(default_factory=deque)  # given back: handed out before any new prompt
    _failures: dict[int, int] = field(default_factory=dict)  # by prompt: its failed episodes so far
    _stale_drops: dict[int, int] = field(default_factory=dict)  # … its groups dropped as too stale

    def hand_out(self) -> tuple[int, Example]:
        """The next prompt: one given back first, else the stream's next."""
        if self._again:
            index = self._again.popleft()
            self.reissued += 1
        else:
            index, self.cursor = self.cursor, self.cursor + 1
            self._pending[index] = next(self.stream)
        return index, self._pending[index]

    def give_back(self, index: int, stale: bool = False) -> None:
        """Prompt ``index`` was not trained — its episode failed, or (``stale``) its group was dropped as
        too stale: hand it out again, unless that has now happened ``MAX_FAILURES`` (failed) or
        ``MAX_STALE_DROPS`` (stale) times."""
        if index not in self._pending or index in self._again:
            raise KeyError(f"prompt {index} is not out")
        counts, limit = (self._stale_drops, MAX_STALE_DROPS) if stale else (self._failures, MAX_FAILURES)
        counts[index] = counts.get(index, 0) + 1
        if counts[index] >= limit:
            why = "its group was dropped as too stale" if stale else "its episode failed"
            log.warning("prompt %d: %s %d times: skipped", index, why, counts[index])
            self._settle(index)
            self.skipped += 1
            return
        self._again.append(index)

    def mark_trained(self, index: int) -> None:
        """Prompt ``index``'s group is in a training step."""
        if index not in self._pending or index in self._again:
            raise KeyError(f"prompt {index} is not out: trained twice, or never handed out")
        self._settle(index)
        self.trained += 1

    @property
    def pending(self) -> list[int]:
        """Handed out and not yet trained (out, or waiting to be handed out again)."""
        return sorted(self._pending)

    @property
    def to_reissue(self) -> list[int]:
        """Given back, waiting to be handed out again, in that order."""
        return list(self._again)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON)."""
        return {"cursor": self.cursor, "pending": self.pending, "trained": self.trained,
                "reissued": self.reissued, "skipped": self.skipped}

    @classmethod
    def restore(cls, state: dict[str, Any] | None, stream_from_start: Iterator[Example]) -> PromptLedger:
        """The ledger a checkpoint kept, over the run's stream from its first prompt: the pending prompts
        are taken from the stream again (they come first), the stream goes on at the cursor. None:
        a fresh run."""
        state = state or {"cursor": 0, "pending": []}
        cursor, pending = int(state["cursor"]), set(map(int, state["pending"]))
        ledger = cls(stream_from_start, cursor, int(state.get("trained", cursor - len(pending))),
                     int(state.get("reissued", 0)), int(state.get("skipped", 0)))
        for index, example in enumerate(itertools.islice(stream_from_start, cursor)):
            if index in pending:
                ledger._pending[index] = example
                ledger._again.append(index)
        return ledger

    def _settle(self, index: int) -> None:
        del self._pending[index]
        self._failures.pop(index, None)
        self._stale_drops.pop(index, None)
