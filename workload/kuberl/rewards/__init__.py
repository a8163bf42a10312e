"""Reward functions, referenced by import path in ``spec.reward.function`` ("module:function").

Contract: ``fn(prompt: str, completion: str, answer: str, **row) -> float`` in [0, 1], plain or
``async def``. ``prompt`` is the text the policy was prompted with (a chat prompt rendered through
the chat template), ``completion`` the generated text up to (not including) the end-of-sequence
token, ``answer`` the dataset's answer column; ``row`` holds every other column of the dataset row
(nested values as they are). A function that takes no ``**kwargs`` gets only the columns it names
as parameters, so ``fn(prompt, completion, answer)`` keeps working.

Rewards run off the rollout's event loop, in worker processes with a time limit per call
(:mod:`.pool`); the cheap string rewards of this module (``INLINE``) run in place.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..api.rewards import KUBERL_REWARDS, KUBERL_REWARDS_MODULE
from ..imports import imported
from .code import code
from .math_answers import math

RewardFn = Callable[..., Any]

__all__ = ["INLINE", "RewardFn", "call_reward", "code", "digit_match", "exact_match", "load_reward", "math",
           "math_answer"]


def exact_match(prompt: str, completion: str, answer: str, **row: Any) -> float:
    """1 if the completion equals the answer after stripping whitespace."""
    return float(completion.strip() == answer.strip())


def digit_match(prompt: str, completion: str, answer: str, **row: Any) -> float:
    """Partial credit for the toy arithmetic tasks: the fraction of the answer's characters that the
    completion gets right, aligned from the right (units digit first); a longer completion than
    the answer is penalised by the same fraction. 1 exactly when the completion equals the answer."""
    got, want = completion.strip(), answer.strip()
    if not want:
        return float(not got)
    right = sum(a == b for a, b in zip(reversed(got), reversed(want), strict=False))
    return right / max(len(want), len(got))


math_answer = math  # the name older manifests use; it was a regex on the last number, which paid wrong answers

INLINE = frozenset({exact_match, digit_match})  # pure string comparisons: cheaper in place than a round trip


def load_reward(path: str, field: str = "spec.reward.function") -> RewardFn:
    """Import ``package.module:function``; errors name the spec field."""
    module_name, _, fn_name = path.partition(":")
    hint = f"; KubeRL's rewards: {', '.join(KUBERL_REWARDS)}" if module_name == KUBERL_REWARDS_MODULE else ""
    try:
        fn = imported(path, field)
    except ValueError as err:
        raise ValueError(f"{err}{hint}") from err
    if not callable(fn):
        raise ValueError(f"{field} {path!r}: {module_name}.{fn_name} is not a function{hint}")
    return fn


@functools.lru_cache(maxsize=64)
def _keyword_names(fn: RewardFn) -> frozenset[str] | None:
    """The keywords ``fn`` takes; None when it takes ``**kwargs`` (once per function: a signature costs
    more than most rewards, and the rollout loop scores every sample)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return frozenset(p.name for p in params if p.kind in named)


def _accepted(fn: RewardFn, row: dict[str, Any]) -> dict[str, Any]:
    """The columns of ``row`` that ``fn`` can take: all with ``**kwargs``, else those it names."""
    try:
        names = _keyword_names(fn)
    except TypeError:  # an unhashable callable: read its signature each time
        names = _keyword_names.__wrapped__(fn)
    return row if names is None else {k: v for k, v in row.items() if k in names}


def call_reward(fn: RewardFn, prompt: str, completion: str, answer: str, row: dict[str, Any]) -> float:
    """``fn``'s verdict as a finite float (an ``async def`` run to completion; True/False are 1/0);
    raises ValueError for anything else, and whatever ``fn`` raises."""
    kwargs = {k: v for k, v in _accepted(fn, row).items() if k not in ("prompt", "completion", "answer")}
    value = fn(prompt, completion, answer, **kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    if not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
        raise ValueError(f"a reward must be a finite number, got {value!r}")
    return float(value)


async def _awaited(value: Any) -> Any:
    return await value
