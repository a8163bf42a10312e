"""The two test tiers. ``slow`` (pyproject's markers) marks every test that starts processes, servers
that take seconds, or training runs, and ``integration`` the real operator on the API emulator; ``scripts/
test --fast`` runs the rest (the inner loop, ≤ 2 min on
2 cores). The marker is kept honest here: a test without it that starts a process — from its own code
or a fixture, on the main thread — fails at its end with a message saying so (an audit hook sees every
``subprocess``, ``os.fork``/``posix_spawn``/``exec``/``system``, and so every multiprocessing start; the
test itself runs as it would, so nothing it waits for is taken from it)."""

from __future__ import annotations

import platform
import sys
import threading
from collections.abc import Generator

import pytest

PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
                            "os.system"})
SLOW = "slow"
INTEGRATION = "integration"  # the real operator on the API emulator: renders the chart's RBAC with helm once


class ProcessWatch:
    """The process starts of the unmarked test running on the main thread (``fast_test``: None when none
    is, or a slow one is)."""

    def __init__(self) -> None:
        self.fast_test: str | None = None
        self.started: list[str] = []

    def audit(self, event: str, _: tuple[object, ...]) -> None:
        on_main_thread = threading.current_thread() is threading.main_thread()
        if event in PROCESS_EVENTS and self.fast_test is not None and on_main_thread:
            self.started.append(event)


WATCH = ProcessWatch()
platform.processor()  # the standard library runs `uname -p` once a process, the first time a client (openai's)
sys.addaudithook(WATCH.audit)  # asks for the platform: not the process of whichever test asks first


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    slow = item.get_closest_marker(SLOW) or item.get_closest_marker(INTEGRATION)
    WATCH.fast_test, WATCH.started = (None if slow else item.nodeid), []
    try:
        return (yield)
    finally:
        WATCH.fast_test = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    report = yield
    if call.when == "teardown" and WATCH.started and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started processes ({', '.join(sorted(set(WATCH.started)))}) but is not "
                           "marked slow: add @pytest.mark.slow (tests/tiers.py; scripts/test --fast leaves slow "
                           "tests out)")
    return report
