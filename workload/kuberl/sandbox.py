"""A sandboxed Python process for the ``python`` tool.

The code runs in a fresh interpreter (``-I -S -B``: no site-packages, no user environment, no
inherited env vars, no bytecode written) in an empty temporary directory, under limits it cannot
raise: CPU seconds, address space, file size (its output goes to a file, so a flood of output stops
at the limit), open files; a wall-clock timeout kills its process group.

Before the code runs, the launcher installs a seccomp filter (libseccomp, through ctypes; the
kernel keeps it for the process's life and no process can lift it) that refuses, with EPERM:

* the network: ``socket`` (every family) and io_uring (which can open sockets on its own);
* other processes: ``fork``/``clone``/``exec`` (nothing is left behind, no fork bomb), signals
  (``kill``, ``tkill``, ``tgkill``, pidfd, sigqueue, and the indirect routes: ``fcntl``'s
  ``F_SETOWN``/``F_SETSIG``/``F_SETOWN_EX`` with ``O_ASYNC``, ``F_SETLEASE``, ``F_NOTIFY``, their
  ``ioctl`` twins), ``ptrace`` and ``process_vm_*``, another
  process's limits (``prlimit64`` with a pid), priority, CPU affinity, scheduling policy, I/O
  priority and memory placement (``setpriority``, ``sched_set*``, ``ioprio_set``,
  ``migrate_pages``, ``move_pages``) — it cannot stop, signal, read, starve or kill through its
  limits the trainer that runs it (a same-uid ``prlimit(RLIMIT_CPU)`` on the parent killed it);
* the filesystem, but for reading: ``open``/``openat`` with any write flag, ``openat2``, and
  every call that creates, removes, renames, links or changes the mode, owner, times or
  attributes of a file;
* namespaces, mounts, BPF, perf, keys, ``personality`` and ``userfaultfd``.

Reads are confined too where the kernel has Landlock (5.13+; ``reads_confined``): the code may read
Python's standard library, the shared libraries and its scratch directory, nothing else — not the
trainer's files, not ``/proc/<pid>/environ`` (the API token). Without Landlock the trainer warns at
start that tool code can read what the trainer's user can. Where Landlock has scopes (6.12+), it
also refuses every signal that would leave the sandbox, whatever the route.

A sandbox dies with the process that started it (``PR_SET_PDEATHSIG``), is the OOM killer's first
choice (``oom_score_adj`` 1000), and is killed with its process group at its wall-clock limit.
:mod:`kuberl.sandbox_launcher` is the code that confines it, in this order.

Neither needs a privilege (only ``no_new_privs``), so this works in a pod under the RuntimeDefault
seccomp profile with every capability dropped — where the namespaces the tool used before
(``unshare``) are refused. Where libseccomp is missing, the tool refuses to run (``available``: the
trainer checks at start, so a run does not train on errors).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import sandbox_launcher

NO_ISOLATION = sandbox_launcher.NO_ISOLATION
LAUNCHER = Path(sandbox_launcher.__file__).read_text()
CODE_FILE = ".code.py"
UNAVAILABLE = ("the python tool needs libseccomp (libseccomp.so.2) to confine the code it runs, and this host "
               "has none; it does not run code unconfined")


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


@dataclass
class Confined:
    """A started sandbox: its process (leader of its own process group) and its output file."""

    process: subprocess.Popen[bytes]
    output_path: Path

    def output(self, limit: int) -> str:
        data = self.output_path.read_bytes() if self.output_path.exists() else b""
        text = data[:limit].decode(errors="replace")
        return text + (f"\n[output cut at {limit} bytes]" if len(data) > limit else "")

    def kill(self) -> None:
        """SIGKILL its process group (a no-op once it is gone) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


@contextmanager
def confined(code: str, limits: Limits, args: Sequence[str] = (), files: dict[str, str] | None = None,
             pass_fds: Sequence[int] = ()) -> Iterator[Confined]:
    """Start ``code`` in a sandbox, in a scratch directory of its own holding ``files``; killed and
    cleaned up on leaving. Its output (stdout and stderr) goes to a file, cut at 4 × the output limit."""
    with tempfile.TemporaryDirectory(prefix="kuberl-tool-") as cwd:
        (Path(cwd) / CODE_FILE).write_text(code, errors="surrogateescape")
        for name, text in (files or {}).items():
            (Path(cwd) / name).write_text(text, errors="surrogateescape")
        output_path = Path(cwd) / ".output"
        with output_path.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", LAUNCHER, str(limits.cpu_seconds),
                 str(limits.memory_bytes), str(limits.output_bytes * 4), str(os.getpid()), CODE_FILE, *args],
                cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                start_new_session=True)
        sandbox = Confined(process, output_path)
        try:
            yield sandbox
        finally:
            sandbox.kill()


def stopped_by(returncode: int) -> str:
    """What a negative return code means, for any signal (real-time ones have no name in ``signal``)."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    reason = {"SIGXCPU": "the CPU time limit", "SIGXFSZ": "the output limit", "SIGKILL": "a limit"}.get(name, name)
    return f"{reason} ({name})"


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run ``code``; Outcome(ok, output or what stopped it)."""
    with confined(code, limits) as sandbox:
        try:
            returncode = sandbox.process.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            return Outcome(False, f"timed out after {limits.wall_seconds:g} s")
        text = sandbox.output(limits.output_bytes)
    if returncode == NO_ISOLATION:
        return Outcome(False, UNAVAILABLE)
    if returncode < 0:
        return Outcome(False, f"stopped by {stopped_by(returncode)}\n{text}".strip())
    if returncode != 0:
        return Outcome(False, "\n".join(text.strip().splitlines()[-5:]))  # the end of the traceback
    return Outcome(True, text)


def available() -> str | None:
    """Why the sandbox cannot run code on this host, or None when it can (one trial run)."""
    outcome = run_python("print('ok')")
    return None if outcome.ok and outcome.output == "ok\n" else outcome.output


def reads_confined() -> bool:
    """Whether tool code is kept from reading files outside Python's library (Landlock; one trial run)."""
    outcome = run_python("open('/proc/self/status')")
    return not outcome.ok and "PermissionError" in outcome.output
