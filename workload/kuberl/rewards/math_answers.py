"""``kuberl.rewards:math``: 1 when the completion's final answer equals the reference answer
mathematically, by Hugging Face's ``math-verify`` (LaTeX and plain expressions parsed to sympy,
compared symbolically and numerically: 0.5 = \\frac{1}{2}, 2\\sqrt{2} = \\sqrt{8}, intervals, sets,
matrices, units and percentages understood), else 0.

- The completion's answer: its last ``\\boxed{…}`` first, else a LaTeX or plain expression at its
  end ("the answer is 7"); two boxed answers are a set, which a single reference does not equal.
- The reference: the dataset's answer as written, GSM8K's ``#### 42`` form understood.
- A reference in words (``\\text{Paris}``, or three or more letters and nothing mathematical) is
  compared as text, case and spacing aside: sympy would read ``Paris`` as the product p·a·r·i·s.
- Each parse and comparison has a time limit (``math-verify``'s own, by SIGALRM: it works in the
  main thread of the reward worker processes, :mod:`.pool`, whose per-call limit backs it up).
- ``math-verify`` (and sympy under it, ≈ 0.7 CPU-s) is imported at the first call: every process that
  imports :mod:`kuberl.rewards` would otherwise pay it, whichever reward the run uses.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from math_verify.parser import ExtractionTarget

TIME_LIMIT_SECONDS = 5  # per parse and per comparison
_WORDS = re.compile(r"^[A-Za-z][A-Za-z '.-]*[A-Za-z.]$")
_TEXT = re.compile(r"^\\(?:text|textbf|mathrm)\{([^{}]*)\}$")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


@functools.cache
def _prediction_configs() -> list[ExtractionTarget]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def reference_text(answer: str) -> str:
    """The reference answer without GSM8K's rationale (the text after ``####``), stripped."""
    return answer.split("####")[-1].strip()


def _words(text: str) -> str | None:
    """``text`` as normalised words when it is a text answer (``\\text{…}`` or ≥ 3 letters), else None."""
    text = text.strip().strip("$").strip()
    inner = _TEXT.match(text)
    if inner:
        return " ".join(inner.group(1).lower().split()).rstrip(".")
    if _WORDS.match(text) and sum(c.isalpha() for c in text) >= 3:
        return " ".join(text.lower().split()).rstrip(".")
    return None


def _final_text(completion: str) -> str:
    boxed = _BOXED.findall(completion)
    return boxed[-1] if boxed else (completion.strip().splitlines() or [""])[-1]


def _time_limit() -> int | None:
    """math-verify's limit where its SIGALRM works (a main thread), else none: the caller's applies."""
    return TIME_LIMIT_SECONDS if threading.current_thread() is threading.main_thread() else None


def math(prompt: str, completion: str, answer: str, **row: Any) -> float:
    """1.0 if ``completion``'s final answer equals ``answer`` (see the module docstring), else 0.0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    limit = _time_limit()
    reference = reference_text(answer)
    words = _words(reference)
    if words is not None:
        return float(_words(_final_text(completion)) == words)
    gold = parse("\\boxed{" + reference + "}", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=limit)
    if not gold:
        gold = parse(reference, extraction_config=[ExprExtractionConfig()], parsing_timeout=limit)
    if not gold:
        return 0.0
    prediction = parse(completion, extraction_config=_prediction_configs(), parsing_timeout=limit)
    return float(bool(prediction) and verify(gold, prediction, timeout_seconds=limit))
