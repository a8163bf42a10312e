"""Rank 0's curves on Weights & Biases and MLflow (``spec.logging``), next to TensorBoard's.

Each tracker gets the same scalars as TensorBoard, the run's spec as its config (W&B's config,
MLflow's params, flattened) and each export's URI (W&B's summary, an MLflow tag). They are fed
through one bounded queue by one thread (:class:`Trackers`): a server that is slow or gone never
holds up a training step. A tracker that fails warns once (the first time); after ``GIVE_UP`` failures in a row it
is dropped with a second warning, and training goes on.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..api.tracking import MlflowSpec, WandbSpec
from ..runconfig import RunConfig

log = logging.getLogger("kuberl.trainer")
QUEUE_SIZE = 10_000  # calls waiting for the tracker thread; past it, calls are dropped (and counted)
GIVE_UP = 3  # failures in a row after which a tracker is dropped
MLFLOW_EXPERIMENT = "kuberl"
WANDB_STEP = "train_step"  # W&B's x-axis: evaluations report their step after later training steps


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def note(self, key: str, value: str) -> None: ...
    def close(self) -> None: ...


class WandbTracker:
    def __init__(self, spec: WandbSpec, run: RunConfig, directory: Path):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=spec.project, entity=spec.entity, name=spec.name or run.experiment, group=spec.group,
            tags=spec.tags or None, config={"experiment": run.experiment, **run.spec.to_wire()}, dir=str(directory),
            mode=spec.mode.value,
            settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True))
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, WANDB_STEP: step})

    def note(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, spec: MlflowSpec, run: RunConfig):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        name = spec.experiment or MLFLOW_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=spec.run_name or run.experiment,
                                             tags={"kuberl.experiment": run.experiment}).info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(run.spec.to_wire()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()])

    def note(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, mlflow_name(key), value)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_name(name: str) -> str:
    """``name`` in the characters MLflow allows in metric and tag names: ``eval/pass@4`` → ``eval/pass_at_4``."""
    return re.sub(r"[^/\w.\- ]", "_", name.replace("@", "_at_"))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` → ``{"a.b": "1"}``; lists as their JSON-ish text."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class Trackers:
    """The configured trackers behind one queue, fed by :meth:`log` / :meth:`note`, which never block
    and never raise; each tracker is created on the thread, so a slow start holds nothing up."""

    def __init__(self, makers: Mapping[str, Callable[[], Tracker]]):
        self.makers = dict(makers)
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        if self.makers:
            self._thread.start()

    @staticmethod
    def for_run(run: RunConfig, directory: Path) -> Trackers:
        """``spec.logging``'s trackers; W&B's offline files under ``directory``."""
        spec, makers = run.spec.logging, {}
        if spec.wandb is not None:
            makers["W&B"] = lambda: WandbTracker(spec.wandb, run, directory)  # wandb adds wandb/
        if spec.mlflow is not None:
            makers["MLflow"] = lambda: MlflowTracker(spec.mlflow, run)
        return Trackers(makers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._put("log", step, dict(metrics))

    def note(self, key: str, value: str) -> None:
        self._put("note", key, value)

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued, close every tracker; give up after ``timeout`` seconds (with a warning)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("trackers (%s): not done %.0f s after the run; what they had not sent is lost",
                        ", ".join(self.makers), timeout)

    def _put(self, verb: str, *args: Any) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._queue.put_nowait((verb, args))
        except queue.Full:
            if self.dropped == 0:
                log.warning("trackers (%s) fall behind: metrics are dropped until they catch up",
                            ", ".join(self.makers))
            self.dropped += 1

    def _run(self) -> None:
        trackers, failures, warned = {}, dict.fromkeys(self.makers, 0), set()
        for name, make in self.makers.items():
            try:
                trackers[name] = make()
                log.info("%s: logging this run", name)
            except Exception as err:  # a third-party library's failure of any kind must not end training
                log.warning("%s: not logging this run (%s: %s); training goes on", name, type(err).__name__, err)
        while (item := self._queue.get()) is not None:
            verb, args = item
            for name, tracker in list(trackers.items()):
                try:
                    getattr(tracker, verb)(*args)
                    failures[name] = 0
                except Exception as err:  # as above: warned, counted, never raised into the run
                    failures[name] += 1
                    if name not in warned:
                        warned.add(name)
                        log.warning("%s: %s failed (%s: %s); training goes on", name, verb, type(err).__name__, err)
                    if failures[name] >= GIVE_UP:
                        log.warning("%s: %d failures in a row; no more logging to it in this run", name, GIVE_UP)
                        del trackers[name]
        for name, tracker in trackers.items():
            try:
                tracker.close()
            except Exception as err:  # as above
                log.warning("%s: closing failed (%s: %s)", name, type(err).__name__, err)
