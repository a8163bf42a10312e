"""``kuberl top`` on a screen a test can read (tests/test_local_run.py watches a resized run with it)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .run_processes import wait_until


class TopScreen:
    """``kuberl top WORKDIR`` redrawing in a real terminal — a tmux pane, read with capture-pane — or, where
    tmux is not installed, ``kuberl top --once`` run again at each look."""

    def __init__(self, work: Path) -> None:
        self.work, self.session = work, f"kuberl-top-{os.getpid()}-{id(self)}"
        self.command = [sys.executable, "-m", "kuberl_cli", "top", str(work)]
        self.tmux = shutil.which("tmux")

    def __enter__(self) -> TopScreen:
        if self.tmux:
            subprocess.run([self.tmux, "new-session", "-d", "-s", self.session, "-x", "160", "-y", "40",
                            shlex.join([*self.command, "--interval", "0.5"])], check=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tmux:
            subprocess.run([self.tmux, "kill-session", "-t", self.session], check=False)

    def screen(self) -> str:
        if self.tmux:
            return subprocess.run([self.tmux, "capture-pane", "-p", "-t", self.session], capture_output=True,
                                  text=True, check=True).stdout
        return subprocess.run([*self.command, "--once"], capture_output=True, text=True, check=True).stdout

    def showing(self, pattern: str) -> str:
        """The first screen that matches ``pattern``."""
        seen: list[str] = []

        def matches() -> bool:
            seen.append(self.screen())
            return re.search(pattern, seen[-1]) is not None

        try:
            wait_until(matches, timeout=60)
        except TimeoutError as err:
            raise AssertionError(f"kuberl top never showed {pattern!r}; its last screen:\n{seen[-1]}") from err
        return seen[-1]
