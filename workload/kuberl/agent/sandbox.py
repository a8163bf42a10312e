"""A sandboxed Python process for the ``python`` tool.

The code runs in a fresh interpreter (``-I -S``: no site-packages, no user environment, no
inherited env vars) in an empty temporary directory, under limits it cannot raise: CPU seconds,
address space, file size (its output goes to a file, so a flood of output stops at the limit),
open files; a wall-clock timeout kills its whole process group. A launcher inside the same process
takes the network away first (a new network namespace: only a loopback that is down); where the
host does not allow that, the tool refuses to run instead of running with network.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NO_ISOLATION = 125  # the launcher's exit code when it cannot take the network away

LAUNCHER = """
import ctypes, resource, sys
cpu, memory, fsize = (int(x) for x in sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0 and libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWNET [| NEWUSER]
    sys.exit(EXIT_NO_ISOLATION)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
code = sys.argv[4]
del ctypes, libc, cpu, memory, fsize
sys.argv = ["tool"]
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
""".replace("EXIT_NO_ISOLATION", str(NO_ISOLATION))


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 2
    memory_bytes: int = 512 * 2**20
    wall_seconds: float = 5.0
    output_bytes: int = 4096


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str


def _read(path: Path, limit: int) -> str:
    data = path.read_bytes() if path.exists() else b""
    text = data[:limit].decode(errors="replace")
    return text + (f"\n[output cut at {limit} bytes]" if len(data) > limit else "")


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run ``code``; Outcome(ok, output or what stopped it)."""
    with tempfile.TemporaryDirectory(prefix="kuberl-tool-") as cwd:
        out_path = Path(cwd) / ".output"
        with out_path.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", LAUNCHER, str(limits.cpu_seconds), str(limits.memory_bytes),
                 str(limits.output_bytes * 4), code],
                cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
            try:
                code_ = proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return Outcome(False, f"timed out after {limits.wall_seconds:g} s")
        text = _read(out_path, limits.output_bytes)
    if code_ == NO_ISOLATION:
        return Outcome(False, "the python tool needs a network namespace (unshare), which this host does not "
                              "allow; it does not run code with network access")
    if code_ < 0:
        name = signal.Signals(-code_).name
        reason = {"SIGXCPU": "the CPU time limit", "SIGXFSZ": "the output limit", "SIGKILL": "a limit"}.get(name, name)
        return Outcome(False, f"stopped by {reason} ({name})\n{text}".strip())
    if code_ != 0:
        return Outcome(False, "\n".join(text.strip().splitlines()[-5:]))  # the end of the traceback
    return Outcome(True, text)
