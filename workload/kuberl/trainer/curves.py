"""Rank 0's training curves as TensorBoard event files (``torch.utils.tensorboard``), and on the
dashboards ``spec.logging`` names (W&B, MLflow: :mod:`.trackers`).

Every step's training, rollout, timing and evaluation metrics go to ``logdir``: ``kuberl run``'s
work dir (``settings.tensorboard_dir``), or in a pod ``/tmp/kuberl-tensorboard``, copied next to the
checkpoints (``<checkpoint uri>tensorboard/``, S3 included) at every checkpoint and at the end, so
``tensorboard --logdir s3://bucket/prefix/tensorboard/`` shows a run whose pods are long gone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

from ..checkpoint import CheckpointError, Store, open_store
from ..runconfig import RunConfig
from ..settings import Settings
from .trackers import Trackers

log = logging.getLogger("kuberl.trainer")
POD_LOGDIR = Path("/tmp/kuberl-tensorboard")
PREFIX = "tensorboard/"


class Curves:
    def __init__(self, logdir: Path, store: Store | None, trackers: Trackers | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir, self.store = logdir, store
        self.writer = SummaryWriter(str(logdir))
        self.trackers = trackers or Trackers({})

    @staticmethod
    def for_run(run: RunConfig, settings: Settings) -> Curves:
        """Where this process's curves go: ``settings.tensorboard_dir`` as it is (a local run's work
        dir), else the pod's scratch, published to the checkpoint store; and ``spec.logging``'s
        trackers (W&B's offline files beside the events, published with them)."""
        logdir, store = settings.tensorboard_dir, None
        if logdir is None:
            uri = settings.checkpoint_location(run.spec.checkpoint.uri)
            logdir, store = POD_LOGDIR, open_store(uri, endpoint=settings.s3_endpoint) if uri else None
        return Curves(logdir, store, Trackers.for_run(run, logdir))

    @property
    def location(self) -> str:
        return f"{self.store.uri}{PREFIX}" if self.store is not None else str(self.logdir)

    def log(self, step: int, metrics: Mapping[str, float | int | None]) -> None:
        """Every finite number in ``metrics`` as a scalar at ``step``."""
        finite = {name: float(value) for name, value in metrics.items()
                  if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)}
        for name, value in finite.items():
            self.writer.add_scalar(name, value, step)
        self.trackers.log(step, finite)

    def note(self, key: str, value: str) -> None:
        """Run metadata for the trackers (an export's URI); TensorBoard has no place for it."""
        self.trackers.note(key, value)

    def publish(self) -> None:
        """Flush; copy the event files to the checkpoint store (a failed copy is logged: the next
        one carries the same files)."""
        self.writer.flush()
        if self.store is None:
            return
        try:
            for path in sorted(p for p in self.logdir.rglob("*") if p.is_file()):
                self.store.upload(path, PREFIX + path.relative_to(self.logdir).as_posix())
        except CheckpointError as err:
            log.warning("TensorBoard events not copied to %s (%s); retried at the next checkpoint", self.location, err)

    def close(self) -> None:
        self.trackers.close()  # first: W&B's offline files are complete before they are published
        self.publish()
        self.writer.close()
