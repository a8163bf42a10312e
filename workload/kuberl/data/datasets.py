"""Prompt/answer streams: ``builtin:NAME`` (generated, seeded, :mod:`.builtin`) and tables
(JSONL, JSON, Parquet files or hub datasets, :mod:`.tables`).

A dataset is an endless, deterministic stream of ``Example``s: the same seed gives the same order
(a table: a new permutation of its rows each epoch), and ``position`` lets a resumed run continue
where it stopped. ``keep`` (e.g. a prompt-length limit) skips rows before they are counted, so
positions stay deterministic; ``DropCount`` says how many distinct rows it skipped.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..api.spec import DatasetSource
from ..settings import DEFAULTS, Settings
from .builtin import BUILTIN, TABLES
from .example import Example
from .tables import DatasetError, example_at, load_table

__all__ = ["DatasetError", "DropCount", "Example", "Keep", "evaluation_examples", "examples"]

Keep = Callable[[Example], bool]


@dataclass
class DropCount:
    """Rows a ``keep`` filter skipped (each counted once, however many epochs meet it)."""

    rows: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.rows)


def is_stream(source: DatasetSource) -> bool:
    """A generated stream (``builtin.BUILTIN``), as opposed to a table (a file, a hub or builtin table)."""
    return source.path.startswith("builtin:") and source.path.removeprefix("builtin:") not in TABLES


def _builtin(source: DatasetSource, seed: int) -> Iterator[Example]:
    name = source.path.removeprefix("builtin:")
    if name not in BUILTIN:
        raise DatasetError(f"spec.dataset.path {source.path!r}; builtin datasets: {', '.join([*BUILTIN, *TABLES])}")
    rng, make = random.Random(seed), BUILTIN[name]
    while True:
        yield make(rng)


def _table(source: DatasetSource, seed: int, settings: Settings, keep: Keep | None,
           dropped: DropCount) -> Iterator[Example]:
    table, rng = load_table(source, settings), random.Random(seed)
    kept_any = False
    while True:
        order = list(range(len(table)))
        rng.shuffle(order)
        for j in order:
            example = example_at(table, j, source)
            if keep is not None and not keep(example):
                dropped.rows.add(j)
                continue
            kept_any = True
            yield example
        if not kept_any:
            raise DatasetError(f"spec.dataset.maxPromptTokens: every one of the {len(table)} rows of "
                               f"{source.path!r} is longer")


def examples(source: DatasetSource, seed: int, position: int = 0, settings: Settings = DEFAULTS,
             keep: Keep | None = None, dropped: DropCount | None = None) -> Iterator[Example]:
    """Endless deterministic stream starting after ``position`` examples (an s3:// file through
    ``settings``' cache and endpoint); rows ``keep`` refuses are skipped and added to ``dropped``."""
    if is_stream(source):
        stream = _builtin(source, seed)
    else:
        stream = _table(source, seed, settings, keep, dropped if dropped is not None else DropCount())
    return itertools.islice(stream, position, None)


EVAL_SEED_OFFSET = 1_000_003  # the evaluation stream of a builtin dataset: another seed than training's


def evaluation_examples(source: DatasetSource, prompts: int, seed: int, settings: Settings = DEFAULTS,
                        keep: Keep | None = None) -> list[Example]:
    """The evaluation set: a table's first ``prompts`` rows (that ``keep`` keeps) in table order, or a
    builtin dataset's first ``prompts`` examples under another seed than the training stream's."""
    if is_stream(source):
        return list(itertools.islice(_builtin(source, seed + EVAL_SEED_OFFSET), prompts))
    table = load_table(source, settings)
    rows = (example_at(table, j, source) for j in range(len(table)))
    return list(itertools.islice((e for e in rows if keep is None or keep(e)), prompts))
