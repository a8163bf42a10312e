"""A rank whose steps stop exits non-zero, so the gang restarts: the watchdog on its own, and two real
gloo ranks where one hangs mid-step (the other's collective times out, the hung one's watchdog fires)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kuberl.local.processes import free_port
from kuberl.trainer.watchdog import EXIT_CODE, StepWatchdog


@pytest.mark.slow
def test_the_watchdog_fires_only_when_beats_stop():
    fired: list[float] = []
    dog = StepWatchdog(0.3, fired.append, poll=0.05).start()
    for _ in range(10):  # steps of 0.1 s: never idle for 0.3 s
        time.sleep(0.1)
        dog.beat()
    assert fired == []
    time.sleep(0.6)
    assert len(fired) == 1 and fired[0] > 0.3
    dog.stop()


RANK = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from kuberl.trainer.watchdog import StepWatchdog
    rank = int(sys.argv[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=3))
    dog = StepWatchdog(3, poll=0.2).start()
    for step in range(3):
        if rank == 1 and step == 1:
            time.sleep(3600)  # hung mid-step: never reaches the collective
        dist.all_reduce(torch.ones(1))
        dog.beat()
    sys.exit(0)
""")


@pytest.mark.slow
def test_a_hung_rank_and_its_peer_both_exit_non_zero():
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port], stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    codes = [p.wait(timeout=60) for p in ranks]
    assert codes[1] == EXIT_CODE, ranks[1].stderr.read()[-2000:]  # the hung one: its watchdog
    assert codes[0] != 0  # the waiting one: the collective's timeout (or its watchdog), not a hang
    assert "no training step finished" in ranks[1].stderr.read()
