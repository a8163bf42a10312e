"""The hostile-code suite (issue 69): known escape and reward-gaming programs, run through the python
tool's sandbox and through ``kuberl.rewards:code``. None signals a live victim; none scores above 0
on tests it fails; correct programs — plain, with a ``__main__`` block, class-based, in place,
HumanEval-style — still score 1."""

from __future__ import annotations

import subprocess

import pytest

from kuberl.rewards.code import code
from kuberl.sandbox import run_python

pytestmark = pytest.mark.slow  # every test runs programs in sandbox processes

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
WRONG = "def add(a, b):\n    return 0\n"

GAMING = {  # each fails the tests, and tries to be paid anyway
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "raise SystemExit": WRONG + "raise SystemExit\n",
    "os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "exit in a __main__ block": WRONG + "import sys\nif __name__ == '__main__':\n    sys.exit(0)\n",
    "sys.exit(main())": "import sys\ndef main():\n    return 0\nsys.exit(main())\n",
    "atexit turns a failure into exit 0": WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "excepthook swallows the failure": WRONG + "import sys\nsys.excepthook = lambda *a: None\n",
    "an object equal to everything": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                                      "    __hash__ = object.__hash__\n"
                                      "def add(a, b):\n    return Anything()\n"),
    "an int subclass equal to everything": ("class I(int):\n    def __eq__(self, other):\n        return True\n"
                                            "    __hash__ = int.__hash__\n"
                                            "def add(a, b):\n    return I(0)\n"),
    "assert disabled by patching AssertionError": WRONG + "import builtins\nbuiltins.AssertionError = OSError\n",
    "printing the result line": WRONG + "print('kuberl-code-result 3')\n",
    "writing the result line to every fd": (WRONG + "import os\nfor fd in range(3, 32):\n    try:\n"
                                            "        os.write(fd, b'kuberl-code-result 3\\n')\n"
                                            "    except OSError:\n        pass\n"),
    "shadowing the builtins the tests use": WRONG + "def len(x):\n    return 0\ndef sorted(x):\n    return x\n",
    "an infinite loop": "def add(a, b):\n    while True:\n        pass\n",
    "exiting during the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "exiting with SystemExit during the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "returning nan": "def add(a, b):\n    return float('nan')\n",
}

CORRECT = {  # (program, tests)
    "plain": ("def add(a, b):\n    return a + b\n", ADD_TESTS),
    "with a __main__ block": ("import sys\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n"
                              "    print(add(int(sys.argv[1]), 2))\n    sys.exit(1)\n", ADD_TESTS),
    "class-based": ("class Solution:\n    def add(self, a, b):\n        return a + b\n",
                    ["assert Solution().add(1, 2) == 3", "s = Solution()", "assert s.add(2, 2) == 4"]),
    "in place": ("def sort_in_place(xs):\n    xs.sort()\n",
                 ["x = [3, 1, 2]", "sort_in_place(x)", "assert x == [1, 2, 3]"]),
    "HumanEval-style": ("def add(a, b):\n    return a + b\n",
                        ["def check(candidate):\n    assert candidate(1, 2) == 3\n    assert add(2, 2) == 4",
                         "check(add)"]),
    "an expected exception": ("def div(a, b):\n    return a / b\n",
                              ["try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\n"
                               "else:\n    raise AssertionError('no error')"]),
    "constants, structures and modules": ("import math\nLIMIT = 10\ndef roots(n):\n"
                                          "    return {i: math.isqrt(i) for i in range(n)}, (n, None)\n",
                                          ["assert LIMIT == 10", "assert roots(5) == ({0: 0, 1: 1, 2: 1, 3: 1, "
                                           "4: 2}, (5, None))", "assert math.pi > 3"]),
}


@pytest.mark.parametrize("name", sorted(GAMING))
def test_no_reward_gaming_program_is_paid(name):
    assert code("", f"```python\n{GAMING[name]}```", "", tests=ADD_TESTS) == 0.0


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_programs_are_paid(name):
    program, tests = CORRECT[name]
    assert code("", f"```python\n{program}```", "", tests=tests) == 1.0


def test_a_program_without_tests_passes_when_it_imports_and_not_when_it_exits():
    assert code("", "def f():\n    return 1\n", "") == 1.0
    assert code("", "import sys\nsys.exit(0)\n", "") == 0.0


ESCAPES = {  # each tries to end or signal VICTIM, a same-uid process beside the sandbox
    "kill": "os.kill(VICTIM, signal.SIGKILL)",
    "kill its group": "os.killpg(VICTIM, signal.SIGKILL)",
    "pidfd": "signal.pidfd_send_signal(os.pidfd_open(VICTIM), signal.SIGKILL)",
    "F_SETOWN + O_ASYNC": ("r, w = os.pipe(); fcntl.fcntl(r, fcntl.F_SETOWN, VICTIM); "
                           "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC); os.write(w, b'x')"),
    "F_SETSIG + O_ASYNC": ("r, w = os.pipe(); fcntl.fcntl(r, 10, signal.SIGKILL); "
                           "fcntl.fcntl(r, fcntl.F_SETOWN, VICTIM); fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC); "
                           "os.write(w, b'x')"),
    "F_SETOWN_EX": "r, w = os.pipe(); fcntl.fcntl(r, 15, struct.pack('ii', 1, VICTIM))",
    "FIOSETOWN": "r, w = os.pipe(); fcntl.ioctl(r, 0x8901, struct.pack('i', VICTIM))",
    "its CPU limit": "import resource; resource.prlimit(VICTIM, resource.RLIMIT_CPU, (0, 0))",
    "a child that outlives it": "os.fork()",
    "ptrace": "ctypes.CDLL(None).ptrace(16, VICTIM, 0, 0)\nos.kill(VICTIM, 9)",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_no_escape_reaches_a_live_victim_through_the_tool_or_the_reward(name):
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    attempt = (f"import ctypes, fcntl, os, signal, struct\nVICTIM = {victim.pid}\n{ESCAPES[name]}\n"
               "def add(a, b):\n    return a + b\n")
    try:
        outcome = run_python(attempt)
        assert not outcome.ok, outcome
        assert code("", attempt, "", tests=ADD_TESTS) == 0.0  # the attempt raised: the program failed
        assert victim.poll() is None, f"{name} reached the victim"
    finally:
        victim.kill()


def test_a_program_cannot_shadow_the_builtins_its_tests_use():
    """The tests' ``sorted`` is Python's own, whatever the program defines under that name."""
    tests = ["assert sorted(unique([3, 1, 3, 2])) == [1, 2, 3]"]
    cheat = "def unique(xs):\n    return []\ndef sorted(xs):\n    return [1, 2, 3]\n"
    honest = "def unique(xs):\n    return list(set(xs))\n"
    assert code("", cheat, "", tests=tests) == 0.0
    assert code("", honest, "", tests=tests) == 1.0


def test_the_code_rewards_sandboxes_end_before_its_call_does():
    """Issue 69, item 1: no sandbox outlives its worker — the code reward's wall clock is below the call's
    own limit, or the manifest is refused naming both."""
    import copy

    from kuberl.api import validate_document
    from kuberl.api.rewards import CODE_WALL_SECONDS
    from kuberl.rewards.code import LIMITS

    from .conftest import MINIMAL

    assert LIMITS.wall_seconds == CODE_WALL_SECONDS
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["reward"] = {"function": "kuberl.rewards:code", "timeoutSeconds": CODE_WALL_SECONDS}
    _, issues = validate_document(doc)
    assert [i.path for i in issues] == ["spec.reward"] and "timeoutSeconds" in issues[0].message, issues
    doc["spec"]["reward"]["timeoutSeconds"] = 30
    assert validate_document(doc)[1] == []
