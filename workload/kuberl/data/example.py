"""One dataset example, as every consumer (rollout, evaluation, SFT, the reward) sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]  # {"role": ..., "content": ...}, as chat templates take them
Prompt = str | tuple[Message, ...]


@dataclass(frozen=True)
class Example:
    """``prompt``: text, or a chat (messages, rendered through the chat template); ``answer``: the
    reference the reward compares with; ``row``: the dataset row's other columns, for the reward."""

    prompt: Prompt
    answer: str
    # (prompt, completion) pairs the SFT warm-up trains on instead of (prompt, answer): e.g. the turns
    # of a tool-using episode
    demonstrations: tuple[tuple[str, str], ...] = ()
    row: dict[str, Any] = field(default_factory=dict, compare=False)
