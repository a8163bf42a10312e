"""The multi-process tests' launcher (tests/workers.py): a port another process took first starts the
workers again on a new one; any other failure is raised at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from .workers import FREE_PORT, start_workers


def _taken_once(rank: int, port: int, flag: str, log: str) -> None:
    """Fails as a store whose port was taken does, the first time only; logs the port it was given."""
    with open(log, "a") as out:
        out.write(f"{port}\n")
    if not Path(flag).exists():
        Path(flag).touch()
        raise RuntimeError(f"The server socket has failed to listen on port {port}: EADDRINUSE")


def _fails(rank: int, port: int) -> None:
    raise ValueError("not a port")


def test_a_taken_port_starts_the_workers_again_on_a_new_one(tmp_path):
    log = tmp_path / "ports"
    start_workers(_taken_once, 1, (FREE_PORT, str(tmp_path / "flag"), str(log)))
    ports = log.read_text().split()
    assert len(ports) == 2 and all(int(p) > 0 for p in ports)  # a fresh port chosen for the second start


def test_any_other_failure_is_raised_at_once():
    with pytest.raises(mp.ProcessRaisedException, match="not a port"):
        start_workers(_fails, 1, (FREE_PORT,))
