"""``kuberl run``'s view of the trainer's ``/progress``: a live bar (tqdm) on a terminal, and where
the stream is not a terminal (a pipe, a log file, CI) one plain line per update, at most every
``interval`` seconds, each well under 200 characters."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

from .api.progress import Progress

MAX_LINE = 160


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _number(value: Any, digits: int = 3) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.{digits}f}"


def plain_line(p: Progress, elapsed: float) -> str:
    """One progress update as a line (never 200 characters or more): step, reward, last evaluation,
    observed staleness, speed, elapsed, ETA."""
    done, total = p.step or 0, max(p.max_steps or 1, 1)
    first = p.first_step or 0
    rate = (done - first) / elapsed if elapsed > 0 and done > first else 0.0
    eta = _clock((total - done) / rate) if rate else "-"
    evaluation = f" eval {_number(p.eval_reward)}" if p.eval_reward is not None else ""
    line = (f"step {done}/{total} ({100 * done // total}%) reward {_number(p.reward)}{evaluation} "
            f"staleness {p.observed_staleness or 0:.4g} {p.tokens_per_second or 0:.4g} tok/s "
            f"elapsed {_clock(elapsed)} eta {eta}")
    return line[:MAX_LINE]


class ProgressDisplay:
    """``clock`` is any monotonic clock; its zero means nothing (``time.monotonic`` counts from the
    host's boot), so the first update prints at once, whatever it reads."""

    def __init__(self, stream: TextIO = sys.stderr, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream, self.interval, self.clock = stream, interval, clock
        self.live = stream.isatty()
        self.started = clock()
        self._bar: tqdm | None = None
        self._last: tuple[int, float | None] | None = None
        self._printed: float | None = None  # when the last plain line was printed; None: never
        self._latest: Progress | None = None

    def update(self, p: Progress) -> None:
        step, total = p.step or 0, p.max_steps or 0
        if self.live:
            if self._bar is None:
                self._bar = tqdm(total=total, initial=step, file=self.stream, unit="step", dynamic_ncols=True)
            self._bar.n = step
            self._bar.set_postfix_str(f"reward {_number(p.reward)} eval {_number(p.eval_reward)} "
                                      f"staleness {p.observed_staleness or 0}", refresh=True)
            return
        self._latest = p
        now, state = self.clock(), (step, p.eval_reward)
        due = self._printed is None or now - self._printed >= self.interval
        if state != self._last and (due or step >= total):
            self._print(p, state, now)

    def _print(self, p: Progress, state: tuple[int, float | None], now: float) -> None:
        print(f"kuberl run: {plain_line(p, now - self.started)}", file=self.stream, flush=True)
        self._last, self._printed = state, now

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar (restarts, the end)."""
        if self._bar is not None:
            self._bar.write(f"kuberl run: {text}", file=self.stream)
        else:
            print(f"kuberl run: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar; without one, print the last update if it has not been printed yet."""
        if self._bar is not None:
            self._bar.close()
        elif self._latest is not None:
            state = (self._latest.step or 0, self._latest.eval_reward)
            if state != self._last:
                self._print(self._latest, state, self.clock())
