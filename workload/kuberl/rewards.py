"""Reward functions, referenced by import path in ``spec.reward.function`` ("module:function").

Contract: ``fn(prompt: str, completion: str, answer: str) -> float`` in [0, 1]. The completion
is the generated text up to (not including) the end-of-sequence token.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1 if the completion equals the answer after stripping whitespace."""
    return float(completion.strip() == answer.strip())


def digit_match(prompt: str, completion: str, answer: str) -> float:
    """Partial credit for the toy arithmetic tasks: the fraction of the answer's characters that the
    completion gets right, aligned from the right (units digit first); a longer completion than
    the answer is penalised by the same fraction. 1 exactly when the completion equals the answer."""
    got, want = completion.strip(), answer.strip()
    if not want:
        return float(not got)
    right = sum(a == b for a, b in zip(reversed(got), reversed(want), strict=False))
    return right / max(len(want), len(got))


def _final_number(text: str) -> float | None:
    boxed = _BOXED.findall(text)
    candidates = _NUMBER.findall(boxed[-1] if boxed else text.split("####")[-1])
    return float(candidates[-1]) if candidates else None


def math_answer(prompt: str, completion: str, answer: str) -> float:
    """1 if the completion's final number (\\boxed{…} first, else the last number) equals the
    answer's (GSM8K's '#### 42' form is understood)."""
    got, want = _final_number(completion), _final_number(answer)
    return float(got is not None and want is not None and abs(got - want) < 1e-6)


def load_reward(path: str) -> RewardFn:
    """Import ``package.module:function``; errors name the spec field."""
    module_name, _, fn_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"spec.reward.function {path!r}: cannot import {module_name!r} ({err})") from err
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"spec.reward.function {path!r}: {module_name} has no function {fn_name!r}")
    return fn
