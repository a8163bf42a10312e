"""``kuberl.ipc`` against a real serving process: results, raised errors, replies out of order, and
either side going away (the trainer's rollout process is served this way)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kuberl.ipc import Caller, PeerGone, connection_pair

SERVED = '''
import os, sys, threading, time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from kuberl.ipc import serve

class Target:
    def add(self, a, b):
        return a + b
    def missing(self, key):
        return {}[key]
    def later(self, seconds, value):
        answer = Future()
        threading.Timer(seconds, answer.set_result, [value]).start()
        return answer
    def block(self):
        time.sleep(120)
    def unsendable(self):
        return threading.Lock()
    def pid(self):
        return os.getpid()
    def exit(self, code):
        os._exit(code)

serve(Connection(int(sys.argv[1])), Target(), inline=("add", "pid"))
os._exit(0)  # as the rollout process does: a call still running there answers nobody
'''


@pytest.fixture
def served() -> Iterator[tuple[Caller, subprocess.Popen[bytes]]]:
    mine, theirs = connection_pair()
    process = subprocess.Popen([sys.executable, "-c", SERVED, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    caller = Caller(mine, "test", process.poll)
    yield caller, process
    process.kill()
    process.wait()


@pytest.mark.slow
def test_calls_run_in_the_other_process_and_errors_come_back(served: tuple[Caller, subprocess.Popen[bytes]]) -> None:
    caller, process = served
    assert caller.call("pid").result(30) == process.pid
    assert caller.call("add", [1], [2]).result(30) == [1, 2]
    with pytest.raises(KeyError) as raised:
        caller.call("missing", "weights").result(30)
    assert "in the serving process" in "".join(raised.value.__notes__)  # with the other side's traceback
    assert "missing" in "".join(raised.value.__notes__)
    with pytest.raises(RuntimeError, match="unsendable's result cannot be sent"):  # not a call that never returns
        caller.call("unsendable").result(30)
    assert caller.call("add", 2, 3).result(30) == 5


@pytest.mark.slow
def test_a_blocked_call_holds_up_no_other(served: tuple[Caller, subprocess.Popen[bytes]]) -> None:
    caller, _ = served
    blocked = caller.call("block")
    slow, quick = caller.call("later", 1.0, "slow"), caller.call("later", 0.0, "quick")
    assert quick.result(30) == "quick" and not slow.done()  # answered as they finish, not in order
    assert slow.result(30) == "slow" and caller.call("add", 2, 3).result(30) == 5
    assert not blocked.done()


@pytest.mark.slow
def test_a_process_that_dies_fails_every_call(served: tuple[Caller, subprocess.Popen[bytes]]) -> None:
    caller, process = served
    blocked = caller.call("block")
    caller.call("exit", 3)
    with pytest.raises(PeerGone, match="exit code 3"):
        blocked.result(30)
    with pytest.raises(PeerGone):
        caller.call("add", 1, 2).result(1)
    assert process.wait(30) == 3


@pytest.mark.slow
def test_closing_ends_the_serving_side_even_while_a_call_blocks(served: tuple[Caller, subprocess.Popen[bytes]]
                                                                ) -> None:
    caller, process = served
    blocked = caller.call("block")
    time.sleep(0.5)  # the call is running there
    caller.close()
    assert process.wait(30) == 0  # serve returned (the blocked call did not hold it)
    with pytest.raises(PeerGone):
        blocked.result(1)
