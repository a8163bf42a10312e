"""``kuberl.rewards:code``: 1 when the completion's program passes the row's tests in the sandbox
(:mod:`kuberl.sandbox`: no network, processes, signals or file writes; CPU, memory, output and
wall-clock limits), else 0.

- The program: the completion's last fenced block (```` ```python ```` or ```` ``` ````), else the
  whole completion.
- The tests: the row's ``tests`` column (Python statements, e.g. ``assert add(1, 2) == 3``; a list
  of them, or one text), else the answer column. Program and tests run as one script; it passes when
  it exits normally within the limits.
"""

from __future__ import annotations

import re
from typing import Any

from ..sandbox import Limits, run_python

LIMITS = Limits(cpu_seconds=5, memory_bytes=1024 * 2**20, wall_seconds=10.0, output_bytes=4096)
_FENCED = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def program_of(completion: str) -> str:
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(answer: str, row: dict[str, Any]) -> str:
    tests = row.get("tests", answer)
    return "\n".join(map(str, tests)) if isinstance(tests, list | tuple) else str(tests)


def code(prompt: str, completion: str, answer: str, **row: Any) -> float:
    """1.0 if the program and then the tests run to the end in the sandbox, else 0.0."""
    script = f"{program_of(completion)}\n\n{tests_of(answer, row)}\n"
    return float(run_python(script, LIMITS).ok)
