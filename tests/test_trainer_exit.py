"""A trainer rank that fails ends at once with the interpreter's report and exit code, even while a
worker thread (a p2p send nobody will take) would hold the interpreter's shutdown."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kuberl.trainer.__main__ import failure_exit_code

FAILING_RANK = '''
import sys, time
from concurrent.futures import ThreadPoolExecutor
from kuberl.collectives import exit_without_teardown
from kuberl.trainer.__main__ import failure_exit_code

ThreadPoolExecutor(1).submit(time.sleep, 120)  # a send to a replica that will never receive it
try:
    raise RuntimeError("the rollout process is gone")
except BaseException as err:
    exit_without_teardown(failure_exit_code(err))
'''


@pytest.mark.slow
def test_a_failed_rank_exits_at_once_with_its_traceback():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FAILING_RANK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "RuntimeError: the rollout process is gone" in done.stderr
    assert time.monotonic() - started < 30  # not the blocked thread's 120 s


@pytest.mark.parametrize(("err", "code", "said"), [
    (SystemExit("invalid spec: spec.algorithm.name: …"), 1, "invalid spec: spec.algorithm.name"),
    (SystemExit(3), 3, ""),
    (SystemExit(None), 0, ""),
    (KeyError("weights"), 1, "KeyError: 'weights'"),
])
def test_the_exit_code_and_report_are_the_interpreters(err, code, said, capsys):
    try:
        raise err
    except BaseException as raised:
        assert failure_exit_code(raised) == code
    assert said in capsys.readouterr().err
