"""A local run's work directory (``kuberl run --workdir``): the files in it that more than one process
reads — the trainer's summary and prompt audit, the pool file the trainer follows, ``kuberl scale``'s
wish, and the values every later run in the directory must see again (its run id, its checkpoint key).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from pathlib import Path

SUMMARY = "summary.json"  # trainer rank 0's run summary, in the work dir
TRACES = "traces.jsonl"  # spec.observability's sampled spans, one per line (Settings.trace_file), in the work dir
PROMPTS_LOG = "prompts.jsonl"  # the prompts of every trained step (Settings.prompts_log), in the work dir
POOL_FILE = "replicas.json"  # the replicas' URLs the trainer follows (settings.replicas_file)
SCALE_FILE = "scale"  # kuberl scale's wish: the number of replicas
PROGRESS_FILE = "progress-url"  # trainer rank 0's /progress (kuberl top reads it)


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` through a partial file renamed over it: a reader sees the old or the new, whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.rename(path)


def replica_url(port: int) -> str:
    """A local replica's URL."""
    return f"http://127.0.0.1:{port}"


def request_replicas(work: Path, count: int) -> None:
    """``kuberl scale WORKDIR --replicas N``: ask the run in ``work`` for ``count`` replicas."""
    if count < 1:
        raise ValueError(f"--replicas {count}: a run needs at least 1 inference replica")
    if not (work / POOL_FILE).is_file():
        raise ValueError(f"{work} is not the work dir of a running kuberl run (no {POOL_FILE})")
    write_whole(work / SCALE_FILE, str(count))


def requested_replicas(work: Path) -> int | None:
    """The replica count ``kuberl scale`` asked for, if it did (and wrote a number)."""
    try:
        return max(1, int((work / SCALE_FILE).read_text()))
    except (FileNotFoundError, ValueError):
        return None


def kept_once(path: Path, make: Callable[[], str]) -> str:
    """The text in ``path``, written by ``make()`` the first time (the file owner-only): a work dir's
    value that every later run in it must see again."""
    if not path.is_file():
        path.touch(mode=0o600)
        path.write_text(make())
    return path.read_text().strip()


def local_run_id(work: Path) -> str:
    """This work dir's run id (kept in ``run-id``): its checkpoints are this run's."""
    return kept_once(work / "run-id", lambda: f"local-{uuid.uuid4().hex}")


def local_checkpoint_key(work: Path) -> str:
    """This work dir's checkpoint signing key (kept in ``checkpoint-key``): what the
    ``<experiment>-checkpoint-key`` Secret is to a trainer pod, so a run resumes from its own signed
    checkpoints only."""
    return kept_once(work / "checkpoint-key", lambda: secrets.token_urlsafe(32))
