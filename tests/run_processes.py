"""The processes of a local run (``kuberl run``), found in /proc: by what their command line names, by
parent, by replica number; and a process hung for a while (SIGSTOP … SIGCONT)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kuberl.api.contract import ENV_REPLICA, ENV_REPLICA_HOST


def wait_until(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    """Until ``condition()`` holds (asked every 0.2 s); TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.2)


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (children of a run carry its work directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return [p for p in pids if p != os.getpid()]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """``pid`` runs (neither gone nor a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pid_of(work: Path, role: str) -> int:
    """The one process of local run ``work`` that runs ``python -m kuberl.<role>``."""
    pids = [p for p in processes_mentioning(str(work)) if f"kuberl.{role}\0" in Path(f"/proc/{p}/cmdline")
            .read_bytes().decode(errors="replace")]
    assert len(pids) == 1, pids
    return pids[0]


def rollout_pid(work: Path) -> int:
    """The rollout process of local run ``work``'s trainer rank 0 (its child)."""
    (pid,) = [p for p in children(pid_of(work, "trainer")) if b"kuberl.trainer.rollout_process" in
              Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


def replica_pid(work: Path, replica: int, host: int = 0) -> int:
    """The pid of local run ``work``'s inference replica ``replica`` (its KUBERL_REPLICA): its process on
    ``host`` (KUBERL_REPLICA_HOST; a one-process replica has only host 0)."""
    for pid in processes_mentioning(str(work)):
        try:
            cmdline, environ = (Path(f"/proc/{pid}/{f}").read_bytes().split(b"\0") for f in ("cmdline", "environ"))
        except OSError:
            continue
        hosted = next((e for e in environ if e.startswith(f"{ENV_REPLICA_HOST}=".encode())),
                      f"{ENV_REPLICA_HOST}=0".encode())
        if b"kuberl.inference" in cmdline and f"{ENV_REPLICA}={replica}".encode() in environ \
                and hosted == f"{ENV_REPLICA_HOST}={host}".encode():
            return pid
    raise AssertionError(f"no inference replica {replica} (host {host}) under {work}")


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process hangs (SIGSTOP) for the block, and goes on (SIGCONT) after it, whatever happened."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
