"""Tool calls parsed from generated text, and the tools that answer them: errors and limits come
back to the model as text, never as exceptions; the python tool runs without network, signals,
processes or writes (a seccomp filter), also where namespaces are refused."""

from __future__ import annotations

import socket
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.agent.tools import ToolCall, calculator, first_call_end, parse_tool_calls, run_tool
from kuberl.sandbox import Limits, run_python


def test_both_call_formats_parse():
    hermes = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    assert parse_tool_calls(hermes) == [ToolCall("calculator", {"expression": "12*7"})]
    encoded = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert parse_tool_calls(encoded) == [ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("37*12=calc(37*12)") == [ToolCall("calculator", {"expression": "37*12"})]
    assert parse_tool_calls("calc((1+2)*3) and calc(4)") == [ToolCall("calculator", {"expression": "(1+2)*3"}),
                                                            ToolCall("calculator", {"expression": "4"})]
    assert parse_tool_calls("no call here") == []
    text = "calc((1+2)*3) then <tool_call>{}</tool_call>"  # a turn ends after its first call, and holds it
    assert text[:first_call_end(text)] == "calc((1+2)*3)" and first_call_end("no call") is None
    broken = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert broken[0].error and run_tool(broken[0]).startswith("error: ")


@pytest.mark.parametrize(("expression", "answer"), [
    ("12*7", "84"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("2**10", "1024"), ("-3+5", "2"), ("10//3", "3"),
    ("1/0", "error: division by zero"), ("2**1000000", "error: exponents above 64 are not supported"),
    ("__import__('os').system('id')", "error: only numbers, + - * / // % ** and parentheses are allowed"),
    ("(" * 300, "error: the expression is longer than 200 characters"), ("1+", "error: not an arithmetic expression"),
])
def test_the_calculator_answers_or_explains(expression, answer):
    assert calculator(expression) == answer


@given(st.text(max_size=60))
def test_any_tool_call_text_gives_a_message_and_never_raises(text):
    for call in parse_tool_calls(f"<tool_call>{text}</tool_call>") + parse_tool_calls(f"calc({text})"):
        assert isinstance(run_tool(call) if call.name != "python" else "", str)
    assert isinstance(calculator(text), str)


def test_unknown_tools_and_bad_arguments_are_messages():
    assert run_tool(ToolCall("rm", {})) == "error: unknown tool 'rm'; tools: calculator, python"
    assert run_tool(ToolCall("calculator", {"expression": 5})).startswith("error: calculator needs a string")


def test_the_python_tool_runs_code_and_reports_its_failures():
    assert run_python("print(6*7)").output == "42\n"
    crashed = run_python("raise ValueError('nope')")
    assert not crashed.ok and "ValueError: nope" in crashed.output
    assert run_tool(ToolCall("python", {"code": "print(sum(range(10)))"})) == "45\n"


@pytest.mark.parametrize(("code", "expected"), [
    ("while True: pass", "CPU time limit"),
    ("import time; time.sleep(30)", "timed out"),
    ("x = bytearray(2**31)", "MemoryError"),
    ("print('x' * 10**6)", "[output cut at 4096 bytes]"),
    ("import os; print(sorted(os.environ))", "LC_CTYPE"),  # nothing of the parent's environment but the locale
])
def test_the_python_tool_stops_at_its_limits(code, expected):
    """Each limit on its own: the wall-clock limit is far away except for the sleeper (on a loaded
    machine a busy loop may get less than a CPU second in a few wall seconds: a CI run saw that)."""
    wall = 3.0 if "sleep" in code else 120.0
    outcome = run_python(code, Limits(cpu_seconds=1, wall_seconds=wall))
    assert expected in outcome.output, outcome


def test_the_python_tool_has_no_network():
    """A server listening on this host's loopback cannot be reached from inside the tool."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    try:
        outcome = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')")
    finally:
        server.close()
    assert not outcome.ok and "in" != outcome.output.strip(), outcome
    assert "Error" in outcome.output


def test_the_python_tool_cannot_signal_write_or_spawn_anything(tmp_path):
    """Tool code runs next to the trainer, as its user: it must not be able to kill it, overwrite
    its files or leave processes behind (issue 24, item 7)."""
    import subprocess

    victim = subprocess.Popen(["sleep", "60"])
    precious = tmp_path / "checkpoint.bin"
    precious.write_bytes(b"weights")
    try:
        attempts = {
            "signal": f"import os; os.kill({victim.pid}, 9)",
            "overwrite": f"open({str(precious)!r}, 'wb').write(b'gone')",
            "append": f"open({str(precious)!r}, 'ab').write(b'gone')",
            "delete": f"import os; os.remove({str(precious)!r})",
            "rename": f"import os; os.rename({str(precious)!r}, {str(precious)!r} + '.x')",
            "create": f"open({str(tmp_path / 'new.txt')!r}, 'x')",
            "fork": "import os; os.fork()",
            "spawn": "import subprocess; subprocess.run(['sleep', '30'])",
            "network": "import socket; socket.socket()",
            "limit": f"import resource; resource.prlimit({victim.pid}, resource.RLIMIT_CPU, (1, 1))",
            "affinity": f"import os; os.sched_setaffinity({victim.pid}, {{0}})",
            "priority": f"import os; os.setpriority(os.PRIO_PROCESS, {victim.pid}, 19)",
        }
        for what, code in attempts.items():
            outcome = run_python(code)
            assert not outcome.ok and ("PermissionError" in outcome.output or "Operation not permitted"
                                       in outcome.output), (what, outcome)
        assert victim.poll() is None and precious.read_bytes() == b"weights"
        own = run_python("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16)); print('own')")
        assert own.ok and "own" in own.output  # its own limits it may still lower
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.bin"]
    finally:
        victim.kill()


def landlock_abi() -> int:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)  # landlock_create_ruleset(VERSION)


@pytest.mark.skipif(landlock_abi() < 1, reason="the kernel has no Landlock: file reads are not confined here")
def test_the_python_tool_reads_nothing_but_the_standard_library(tmp_path):
    """Tool code runs as the trainer's user: without more, it could read the trainer's files and
    /proc/<trainer>/environ, which holds the API token. Landlock confines its reads to Python's own
    library (and its scratch directory)."""
    import os

    precious = tmp_path / "checkpoint.bin"
    precious.write_bytes(b"weights")
    for path in (precious, f"/proc/{os.getpid()}/environ", "/proc/self/status", "/etc/passwd"):
        outcome = run_python(f"print(open({str(path)!r}, 'rb').read()[:10])")
        assert not outcome.ok and "PermissionError" in outcome.output, (path, outcome)
    libraries = run_python("import json, decimal, fractions, re; print(json.dumps(str(fractions.Fraction(1, 3))))")
    assert libraries.ok and libraries.output == '"1/3"\n', libraries


def test_the_python_tool_runs_where_unshare_is_refused():
    """A pod under the RuntimeDefault seccomp profile (capabilities dropped) may not create
    namespaces: the tool ran nothing there before. A parent that refuses unshare and clone's
    namespace flags stands in for that profile; the tool runs inside it."""
    import subprocess

    refuse_namespaces = '''
import ctypes, sys
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
ctx = ctypes.c_void_p(lib.seccomp_init(0x7FFF0000))
for name in (b"unshare", b"setns"):
    assert lib.seccomp_rule_add_array(ctx, 0x00050001, lib.seccomp_syscall_resolve_name(name), 0, None) == 0
assert lib.seccomp_load(ctx) == 0
assert ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0  # CLONE_NEWNET: refused, as in the pod
from kuberl.sandbox import run_python
print(run_python("print(6 * 7)").output, end="")
'''
    done = subprocess.run([sys.executable, "-c", refuse_namespaces], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "42\n", done.stderr
