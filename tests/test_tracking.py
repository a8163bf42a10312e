"""spec.logging's trackers: one whose server is gone warns once and never stops training; MLflow's
names. (A run's curves on W&B and MLflow, read back: tests/test_after_the_run.py.)"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.api.spec import RLExperimentSpec
from kuberl.runconfig import RunConfig
from kuberl.trainer.trackers import Trackers, mlflow_name

WANDB = Path(sys.executable).parent / "wandb"


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of an offline W&B run, as ``wandb leet inspect --json`` (the library's reader) gives them."""
    [log_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(log_file)], capture_output=True, text=True,
                          timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_a_tracker_whose_server_is_gone_warns_once_and_nothing_raises(tmp_path: Path, caplog, monkeypatch):
    """MLflow against a port nobody listens on (its client's retries off): the run's calls return, one
    warning says the tracker is not logging, and closing does not hang."""
    pytest.importorskip("mlflow", reason="the tracking extra is not installed (the dev extra installs it)")
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    spec = RLExperimentSpec.model_validate({
        "model": {"path": "builtin:tiny-qwen2"}, "dataset": {"path": "builtin:arithmetic"},
        "reward": {"function": "kuberl.rewards:exact_match"},
        "logging": {"mlflow": {"trackingUri": f"http://127.0.0.1:{port}"}}})
    trackers = Trackers.for_run(RunConfig("gone", spec), tmp_path)
    with caplog.at_level(logging.WARNING, logger="kuberl.trainer"):
        for step in range(1, 50):
            trackers.log(step, {"train/reward": 0.5})
        trackers.note("export/uri", "file:///x/")
        trackers.close(timeout=120)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("MLflow: not logging this run"), warnings


def test_mlflow_names_keep_to_mlflows_characters():
    assert mlflow_name("eval/pass@16") == "eval/pass_at_16"
    assert mlflow_name("timeperf/wait_rollout") == "timeperf/wait_rollout"
