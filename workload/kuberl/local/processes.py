"""The child processes of a local run, kept alive the way a kubelet and a controller keep pods: each
its own process group with its log in the work dir, a replaced process appending to its
predecessor's log, and every child terminated (then killed) when the run ends."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..api.contract import MASTER_PORT

KINDS = {"inference": "inference replica", "agent": "agent"}
REPLICA_RESTARTS = 5  # per replica (or agent), before the run fails
Process = subprocess.Popen[bytes]


class RunError(RuntimeError):
    """A user-facing failure of `kuberl run`; the message says what to change."""


def ephemeral_ports(text: str | None) -> range:
    """The kernel's range for outgoing connections' local ports (``/proc/sys/net/ipv4/ip_local_port_range``
    text, e.g. "32768\t60999"; Linux's default when unknown)."""
    low, high = (int(x) for x in text.split()) if text else (32768, 60999)
    return range(low, high + 1)


def kernel_ephemeral_ports() -> range:
    """This host's ephemeral range (:func:`ephemeral_ports` of ``/proc/sys/net/ipv4/ip_local_port_range``)."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return ephemeral_ports(path.read_text() if path.exists() else None)


WELL_KNOWN_PORTS = frozenset({MASTER_PORT, MASTER_PORT + 1})  # torch.distributed's default store, the exchange's


def candidate_ports() -> list[int]:
    """Where :func:`free_port` looks: the 12,000 ports *below* the ephemeral range (a port from
    ``bind(0)`` is one the kernel also hands to outgoing connections, so under load another socket
    could take it before the process binds it — as a CI run saw, EADDRINUSE), less the well-known
    ones a torchrun job on the same host binds whenever it starts (29500, 29501: the pods of the e2e
    tests' kubelet stand-in too — a local run on the other worker once took 29500 from one)."""
    ephemeral = kernel_ephemeral_ports()
    return [p for p in range(max(10000, ephemeral.start - 12000), ephemeral.start) if p not in WELL_KNOWN_PORTS]


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on, for a process that binds it later: one of
    :func:`candidate_ports` at random; ``bind(0)`` when none of 50 tries is free."""
    rng, below = random.SystemRandom(), candidate_ports()
    for port in (rng.choice(below) for _ in range(50)) if below else ():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


@dataclass
class ProcessUnit:
    """Processes that live and die together: a replica over several hosts (as LeaderWorkerSet recreates
    a group when one pod fails). Once one has exited, the others are killed, and the unit has exited
    with the first one's code; ``pid`` is the leader's."""

    members: list[Process]
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.members[0].pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        exited = [p for p in self.members if p.poll() is not None]
        if not exited:
            return None
        for p in self.members:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.returncode = exited[0].returncode
        return self.returncode


Supervised = Process | ProcessUnit


def restart_exited(procs: list[Supervised], spawn: Callable[[int], Supervised], kind: str,
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
