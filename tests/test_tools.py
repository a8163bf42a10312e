"""Tool calls parsed from generated text, and the tools that answer them: errors and limits come
back to the model as text, never as exceptions; the python tool runs without network, signals,
processes or writes (a seccomp filter), also where namespaces are refused."""

from __future__ import annotations

import socket
import subprocess
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


@pytest.mark.slow
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
@pytest.mark.slow
def test_the_python_tool_stops_at_its_limits(code, expected):
    """Each limit on its own: the wall-clock limit is far away except for the sleeper (on a loaded
    machine a busy loop may get less than a CPU second in a few wall seconds: a CI run saw that)."""
    wall = 3.0 if "sleep" in code else 120.0
    outcome = run_python(code, Limits(cpu_seconds=1, wall_seconds=wall))
    assert expected in outcome.output, outcome


@pytest.mark.slow
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


@pytest.mark.slow
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
@pytest.mark.slow
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


@pytest.mark.slow
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


SIGIO_ROUTES = {  # each makes the kernel send SIGIO (default action: terminate) to VICTIM once the pipe is written
    "F_SETOWN": "fcntl.fcntl(r, fcntl.F_SETOWN, VICTIM)",
    "F_SETOWN to its group": "fcntl.fcntl(r, fcntl.F_SETOWN, -VICTIM)",
    "F_SETOWN_EX": "fcntl.fcntl(r, 15, struct.pack('ii', 1, VICTIM))",  # F_OWNER_PID
    "FIOSETOWN": "fcntl.ioctl(r, 0x8901, struct.pack('i', VICTIM))",
    "SIOCSPGRP": "fcntl.ioctl(r, 0x8902, struct.pack('i', VICTIM))",
}
SIGIO_TRIGGER = "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC); os.write(w, b'x'); print('sent')"


def sigio_attempt(route: str, victim: int) -> str:
    return (f"import fcntl, os, struct\nVICTIM = {victim}\nr, w = os.pipe()\n"
            f"{SIGIO_ROUTES[route]}\n{SIGIO_TRIGGER}\n")


@pytest.mark.parametrize("route", sorted(SIGIO_ROUTES))
@pytest.mark.slow
def test_tool_code_cannot_have_the_kernel_signal_another_process(route):
    """Issue 69, item 1: ``F_SETOWN`` (or its twins) + ``O_ASYNC`` on a pipe makes the kernel send SIGIO
    to any same-uid pid or group — a gang restart from one completion. The owner cannot be set."""
    import subprocess

    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        outcome = run_python(sigio_attempt(route, victim.pid))
        assert not outcome.ok and "PermissionError" in outcome.output, outcome
        assert victim.poll() is None
    finally:
        victim.kill()


def in_child(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("route", ["F_SETOWN", "FIOSETOWN"])
@pytest.mark.slow
def test_the_seccomp_filter_alone_refuses_the_signal_routes(route):
    """Seccomp holds on every kernel (Landlock's signal scope needs 6.12): the launcher's filter alone,
    installed in a child, refuses setting an fd's owner; the victim lives."""
    import subprocess

    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        script = ("from kuberl import sandbox_launcher as launcher\nassert launcher.filtered()\n"
                  + sigio_attempt(route, victim.pid))
        done = in_child(script)
        assert done.returncode != 0 and "PermissionError" in done.stderr, done
        assert victim.poll() is None
    finally:
        victim.kill()


@pytest.mark.skipif(landlock_abi() < 6, reason="the kernel's Landlock has no signal scope (ABI 6, Linux 6.12)")
@pytest.mark.slow
def test_landlocks_signal_scope_alone_stops_sigio_to_another_process():
    """Where the kernel has it, Landlock's signal scope stops the SIGIO at delivery, whatever set the
    owner: the launcher's ``confine`` alone (no seccomp filter), and F_SETOWN succeeds yet the victim lives."""
    import subprocess
    import time

    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        script = ("import fcntl, os, struct\nfrom kuberl import sandbox_launcher as launcher\n"
                  "assert launcher.confine([])\n"
                  + sigio_attempt("F_SETOWN", victim.pid))
        done = in_child(script)
        assert done.returncode == 0 and "sent" in done.stdout, done
        time.sleep(0.2)
        assert victim.poll() is None, "SIGIO reached a process outside the sandbox"
    finally:
        victim.kill()


@pytest.mark.slow
def test_a_sandbox_dies_with_its_parent_and_is_the_oom_killers_first_choice():
    """No sandbox outlives the worker that waits for it (PR_SET_PDEATHSIG), and under memory pressure
    the kernel kills a sandbox before the trainer (oom_score_adj 1000)."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    parent = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom kuberl.sandbox import Limits, confined\n"
        "with confined('import time; time.sleep(60)', Limits(wall_seconds=60)) as box:\n"
        "    print(box.process.pid, flush=True)\n    time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    status = Path(f"/proc/{child}/stat")

    def alive() -> bool:
        try:
            return status.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/oom_score_adj").read_text().strip() != "1000" and time.monotonic() < deadline:
            time.sleep(0.05)  # the launcher sets it first thing; it may not have started yet
        assert Path(f"/proc/{child}/oom_score_adj").read_text().strip() == "1000"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(), "the sandbox outlived its parent"
    finally:
        parent.kill()
        if alive():
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_code_travels_by_file_and_every_death_is_reported():
    """Code larger than the kernel's 128 KiB per argument, or holding a NUL byte, is run or refused
    with a message, never an exception in the caller; a death by a real-time signal has no name in
    ``signal`` and is still reported."""
    from kuberl.sandbox import stopped_by

    big = run_python("x = '" + "a" * 200_000 + "'\nprint(len(x))")
    assert big.ok and big.output == "200000\n", big
    nul = run_python("print(1)\0")
    assert not nul.ok and "null bytes" in nul.output, nul
    assert stopped_by(-37) == "signal 37" and stopped_by(-24) == "the CPU time limit (SIGXCPU)"
