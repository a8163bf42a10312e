"""The child processes of a local run, kept alive the way a kubelet and a controller keep pods: each
its own process group with its log in the work dir, a replaced process appending to its
predecessor's log, and every child terminated (then killed) when the run ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KINDS = {"inference": "inference replica", "agent": "agent"}
REPLICA_RESTARTS = 5  # per replica (or agent), before the run fails
Process = subprocess.Popen[bytes]


class RunError(RuntimeError):
    """A user-facing failure of `kuberl run`; the message says what to change."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Children:
    procs: list[Process] = field(default_factory=list)

    def spawn(self, args: list[str], env: dict[str, str], cores: list[int] | None, log: Path,
              cwd: Path | None = None) -> Process:
        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, cores)

        out = open(log, "ab")  # a restarted process appends to its predecessor's log
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin,
                                start_new_session=True, cwd=cwd)
        self.procs.append(proc)
        return proc

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def restart_exited(procs: list[Process], spawn: Callable[[int], Process], kind: str,
                   logs: str, restarts: dict[str, int], limit: int, say: Callable[[str], None]) -> None:
    """Replace every process of ``procs`` that exited (``spawn(i)`` makes process i again), the way
    a controller replaces a pod; past ``limit`` restarts of ``kind`` the run fails with the log's tail
    (``logs``: the log path with ``{}`` for i)."""
    what = KINDS.get(kind, kind)
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            continue
        log = Path(logs.format(i))
        if restarts[kind] >= limit:
            raise RunError(f"{what} {i} keeps failing (exit {proc.returncode}); last lines of {log}:\n"
                           f"{tail(log)}")
        restarts[kind] += 1
        say(f"{what} {i} exited with code {proc.returncode}; restarting it; last lines of {log}:\n"
            f"{indented(tail(log, 5))}")
        procs[i] = spawn(i)


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def indented(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())
