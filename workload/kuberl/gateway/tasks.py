"""Tasks for agents from the experiment's dataset: each handed out ``group_size`` times under one
group key, so the sessions that solve it form one GRPO group (pure)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..data.datasets import Example

REMEMBERED = 4096  # tasks kept for scoring {"completion": ...} rewards


@dataclass
class TaskDealer:
    data: Iterator[Example]
    group_size: int
    dealt: int = 0
    tasks: OrderedDict[str, Example] = field(default_factory=OrderedDict)

    def next(self) -> tuple[str, Example]:
        """(group key, task): a new task every ``group_size`` calls."""
        number, seat = divmod(self.dealt, self.group_size)
        self.dealt += 1
        key = f"task-{number}"
        if seat == 0:
            self.tasks[key] = next(self.data)
            while len(self.tasks) > REMEMBERED:
                self.tasks.popitem(last=False)
        return key, self.tasks[key]

    def task(self, key: str) -> Example | None:
        return self.tasks.get(key)
