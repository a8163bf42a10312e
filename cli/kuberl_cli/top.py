"""``kuberl top``: one screen for a running experiment, redrawn every few seconds.

Two sources, one view: a local run's work dir (trainer rank 0's ``/progress``, whose URL ``kuberl run``
writes to ``progress-url``, and each replica's ``/health`` — status, policy version, requests in flight
— from the pool file the trainer follows), or an experiment on a cluster through ``kubectl proxy``
(``--api``: its ``status.progress`` and the pool's replica counts; nothing to authenticate here, the
proxy does it with the user's kubeconfig). :func:`frame` is the screen, pure; the rest fetches.

    kuberl top /tmp/kuberl-cpu-tiny-XXXX                 # a local run
    kubectl proxy & kuberl top cpu-tiny --api http://127.0.0.1:8001 -n team-a
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kuberl.api import Progress
from kuberl.local.workdir import POOL_FILE, PROGRESS_FILE, SUMMARY

from .fetch import experiment_url, get_json, read_object

SPARKS = "▁▂▃▄▅▆▇█"
HISTORY = 60  # rewards kept for the sparkline (one per step seen)
FETCH_SECONDS = 2.0
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Replica:
    name: str
    status: str  # "ok", what /health says is wrong, or "unreachable"
    version: int | None = None
    in_flight: int | None = None


@dataclass
class View:
    """What the screen shows; ``rewards``: (step, reward) as seen, oldest first."""

    title: str
    phase: str | None = None
    progress: Progress | None = None
    replicas: list[Replica] = field(default_factory=list)
    replica_counts: tuple[int, int] | None = None  # (ready, all), where replicas cannot be asked one by one
    rewards: list[tuple[int, float]] = field(default_factory=list)
    note: str | None = None

    def seen(self, progress: Progress | None) -> None:
        """Keep ``progress`` and its step's reward for the sparkline (once per step)."""
        self.progress = progress
        if progress is None or progress.step is None or progress.reward is None:
            return
        if not self.rewards or self.rewards[-1][0] != progress.step:
            self.rewards = [*self.rewards, (progress.step, progress.reward)][-HISTORY:]


def sparkline(values: list[float]) -> str:
    """Each value as one of eight bars, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))] for v in values)


def _number(value: float | int | None, spec: str = "", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _push_line(progress: Progress) -> str | None:
    push = progress.last_push
    if push is None:
        return None
    fell_back = f" (fell back: {push.reason or '?'})" if push.fell_back else ""
    line = (f"last push v{push.version} {push.mode}{fell_back} ({push.transport or '?'})"
            f" {push.bytes_per_replica / 1e6:.1f} MB/replica in {push.seconds:.3f} s"
            f" ({_number(push.gigabytes_per_second, '.2f')} GB/s) to {push.replicas} replica(s)")
    if push.replicas_lost:
        line += f", {push.replicas_lost} lost"
    if push.slowest_replica and push.slowest_ratio:
        line += f", slowest {push.slowest_replica} ×{push.slowest_ratio:.1f}"
    if push.planned_port_bytes is not None:
        line += (f"; plan's busiest port {push.planned_port_bytes / 1e6:.1f} MB at "
                 f"{_number(push.port_gigabytes_per_second, '.2f')} GB/s")
    return line


def frame(view: View, now: str) -> list[str]:
    """The screen's lines."""
    p = view.progress
    lines = [f"kuberl top — {view.title} · {now}"]
    if p is None:
        return [*lines, view.note or "waiting for the trainer's progress…"]
    lines.append(f"phase {view.phase or p.phase or '–'}   step {_number(p.step)}/{_number(p.max_steps)}   "
                 f"version {_number(p.version)}   last step {_number(p.step_seconds, '.2f')} s   "
                 f"{_number(p.tokens_per_second, '.0f')} tokens/s")
    rewards = [r for _, r in view.rewards]
    lines.append(f"reward {_number(p.reward, '.3f')}  {sparkline(rewards)}  (last {len(rewards)} steps seen; "
                 f"first 10 {_number(p.reward_first10, '.3f')}, last 10 {_number(p.reward_last10, '.3f')})")
    if p.eval_reward is not None:
        lines.append(f"eval {p.eval_reward:.3f} at step {_number(p.eval_step)} (version {_number(p.eval_version)}, "
                     f"span {_number(p.eval_version_span)})")
    lines.append(f"staleness {_number(p.observed_staleness)} (budget used {_number(p.staleness_budget_used, '.0%')}, "
                 f"late groups trained {_number(p.late_groups_trained)})   waiting for rollouts "
                 f"{_number(p.rollout_wait_fraction, '.0%')}   groups ready {_number(p.rollout_ready_groups)}")
    lines.append(f"prompts trained {_number(p.prompts_trained)}, re-issued {_number(p.prompts_reissued)}, "
                 f"skipped {_number(p.prompts_skipped)}   last checkpoint {p.last_checkpoint or '–'}")
    push = _push_line(p)
    if push:
        lines.append(push)
    if view.replica_counts is not None:
        lines.append(f"replicas {view.replica_counts[0]} ready of {view.replica_counts[1]}")
    elif view.replicas:
        lines.append(f"replicas ({len(view.replicas)})")
        lines += [f"  {r.name}  {r.status}  version {_number(r.version)}  in flight {_number(r.in_flight)}"
                  for r in view.replicas]
    if view.note:
        lines.append(view.note)
    return lines


def replica_health(url: str) -> Replica:
    """One replica's ``/health``: status, version, requests in flight."""
    try:
        _, body = get_json(f"{url}/health", FETCH_SECONDS)
    except (OSError, ValueError) as err:
        return Replica(url, f"unreachable ({type(err).__name__})")
    return Replica(url, str(body.get("status", "?")), body.get("version"), body.get("inFlight"))


def local_source(work: Path) -> Callable[[View], bool]:
    """Refresh ``view`` from the run in ``work``; False once the run has ended."""
    if not (work / PROGRESS_FILE).is_file():
        raise ValueError(f"{work}: not the work dir of a kuberl run (no {PROGRESS_FILE})")
    url = (work / PROGRESS_FILE).read_text().strip()

    def refresh(view: View) -> bool:
        try:
            _, body = get_json(url, FETCH_SECONDS)
            view.seen(Progress.from_reply(body))
        except (OSError, ValueError):
            ended = (work / SUMMARY).is_file()
            view.note = "the run has ended (summary.json)" if ended else "the trainer does not answer yet"
            return not ended
        view.note = None
        urls = json.loads((work / POOL_FILE).read_text()) if (work / POOL_FILE).is_file() else []
        view.replicas = [replica_health(u) for u in urls]
        return True

    return refresh


def cluster_source(api: str, namespace: str, name: str) -> Callable[[View], bool]:
    """Refresh ``view`` from the RLExperiment through ``kubectl proxy`` at ``api``; False once it has
    Succeeded or Failed."""
    url = experiment_url(api, namespace, name)

    def refresh(view: View) -> bool:
        status = read_object(url, FETCH_SECONDS).get("status") or {}
        view.phase = status.get("phase")
        progress = status.get("progress")
        view.seen(Progress.from_reply(progress) if progress else None)
        view.replica_counts = (status.get("readyReplicas") or 0, status.get("replicas") or 0)
        return view.phase not in ("Succeeded", "Failed")

    return refresh


def run(refresh: Callable[[View], bool], view: View, interval: float, once: bool,
        write: Callable[[str], None]) -> int:
    """Redraw until the run ends (the last screen stays), Ctrl-C, or after one screen with ``once``."""
    try:
        while True:
            going = refresh(view)
            write(("" if once else CLEAR) + "\n".join(frame(view, time.strftime("%H:%M:%S"))) + "\n")
            if once or not going:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
