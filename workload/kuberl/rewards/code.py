"""``kuberl.rewards:code``: 1 when the completion's program passes every one of the row's tests, else 0.

- The program: the completion's last fenced block (```` ```python ```` or ```` ``` ````), else the
  whole completion.
- The tests: the row's ``tests`` column (Python statements, e.g. ``assert add(1, 2) == 3``; a list
  of them, or one text), else the answer column. With no test at all, a program that imports without
  error passes.

Threat model: the program is written by the policy being trained, which is rewarded for passing —
so it will find any way to pass that is not solving the task. Program and tests run as two units,
each in a sandbox of its own (:mod:`kuberl.sandbox`: no network, processes, signals or file writes;
reads confined by Landlock; CPU, memory, output and wall-clock limits), linked by two pipes
(:mod:`.code_harness`):

- ending early pays nothing: ``sys.exit(0)``, ``raise SystemExit``, ``os._exit(0)`` or a
  ``__main__`` block that exits end the *program's* process; the tests' side then fails. The program
  is imported as ``solution``, so its ``if __name__ == "__main__":`` block does not run at all;
- patching builtins, the harness or the test functions changes only the program's own process;
- only plain data crosses back (``ast.literal_eval`` of exact builtin types), so an object whose
  ``__eq__`` always answers True cannot pass a comparison;
- the reward is paid on one line the tests' side writes, after its last statement, on a pipe the
  program's process never holds: nothing the program prints counts.

Not covered: where the kernel has no Landlock, the program can read what the trainer's user can —
the dataset, hence the tests — and answer from it (the trainer warns at start, see
:func:`kuberl.sandbox.reads_confined`). Tests are the dataset's, trusted: they run sandboxed anyway.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from ..api.rewards import CODE_WALL_SECONDS
from ..sandbox import Limits, confined
from . import code_harness

LIMITS = Limits(cpu_seconds=5, memory_bytes=1024 * 2**20, wall_seconds=CODE_WALL_SECONDS, output_bytes=4096)
HARNESS = Path(code_harness.__file__).read_text()
_FENCED = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def program_of(completion: str) -> str:
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(answer: str, row: dict[str, Any]) -> str:
    tests = row.get("tests", answer)
    return "\n".join(map(str, tests)) if isinstance(tests, list | tuple) else str(tests)


def statements_in(tests: str) -> int | None:
    """How many top-level statements ``tests`` holds (None when it is not Python)."""
    try:
        return len(ast.parse(tests).body)
    except (SyntaxError, ValueError):
        return None


def passes(program: str, tests: str, limits: Limits = LIMITS) -> bool:
    """Whether every statement of ``tests`` ran against ``program`` (two sandboxes, one wall clock):
    the tests' side exited 0 and wrote ``RESULT n`` with n the number of statements here."""
    if (count := statements_in(tests)) is None:
        return False
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    result_r, result_w = os.pipe()
    parent_copies = [requests_r, replies_w, requests_w, replies_r, result_w]  # the sandboxes' ends
    try:
        with (confined(HARNESS, limits, ["program", "solution.py", str(requests_r), str(replies_w)],
                       {"solution.py": program}, pass_fds=(requests_r, replies_w)),
              confined(HARNESS, limits, ["tests", "tests.py", str(requests_w), str(replies_r), str(result_w)],
                       {"tests.py": tests}, pass_fds=(requests_w, replies_r, result_w)) as tests_side):
            while parent_copies:  # else neither side would see the other's end of a pipe close
                os.close(parent_copies.pop())
            try:
                returncode = tests_side.process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                return False
            result = os.read(result_r, 256).decode(errors="replace")
    finally:
        for fd in [*parent_copies, result_r]:
            os.close(fd)
    return returncode == 0 and result == f"{code_harness.RESULT} {count}\n"


def code(prompt: str, completion: str, answer: str, **row: Any) -> float:
    """1.0 if the program passes every test of the row in the sandboxes, else 0.0."""
    return float(passes(program_of(completion), tests_of(answer, row)))
