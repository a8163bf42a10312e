"""spec.logging: a run's curves on W&B (offline, read back with wandb's own reader) and MLflow (a file
store, read back with MlflowClient) — the same rewards as the run's summary, its spec as config, its
export's URI — and a tracker whose server is gone warns and never stops training."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.api.spec import RLExperimentSpec
from kuberl.local import run_local
from kuberl.runconfig import RunConfig
from kuberl.trainer.trackers import Trackers, mlflow_name

from .conftest import ROOT

WANDB = Path(sys.executable).parent / "wandb"


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of an offline W&B run, as ``wandb leet inspect --json`` (the library's reader) gives them."""
    [log_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(log_file)], capture_output=True, text=True,
                          timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_a_runs_curves_reach_wandb_offline_and_an_mlflow_file_store(tmp_path: Path, monkeypatch):
    pytest.importorskip("wandb", reason="the tracking extra is not installed (the dev extra installs it)")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    steps, store = 6, f"file://{tmp_path}/mlruns"
    summary = run_local(ROOT / "examples/cpu-tiny.yaml", [
        "model.sftWarmup.steps=5", "evaluation.everySteps=3", "evaluation.prompts=8", "evaluation.samplesPerPrompt=2",
        "logging.wandb.project=kuberl-tests", "logging.wandb.mode=offline", "logging.wandb.tags=[ci]",
        f"logging.mlflow.trackingUri={store}", "logging.mlflow.experiment=kuberl-tests"],
        steps, None, workdir=tmp_path / "run", quiet=True)
    rewards, export = summary["rewards"], summary["export"]["uri"]

    records = wandb_records(tmp_path / "run" / "tensorboard")
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    trained = {h["train_step"]: h["train/reward"] for h in history if "train/reward" in h}
    assert sorted(trained) == list(range(1, steps + 1))
    assert [round(trained[s], 4) for s in sorted(trained)] == rewards
    assert sorted(h["train_step"] for h in history if "eval/reward" in h) == [0, 3, 6]
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "kuberl-tests" and run["config"]["update"]["algorithm"]["name"] == "grpo"
    summaries = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"].get("update", {}).items()}
    assert summaries["export/uri"] == export

    client = MlflowClient(store)
    [found] = client.search_runs([client.get_experiment_by_name("kuberl-tests").experiment_id])
    curve = client.get_metric_history(found.info.run_id, "train/reward")
    assert [m.step for m in curve] == list(range(1, steps + 1))
    assert [round(m.value, 4) for m in curve] == rewards
    assert [m.step for m in client.get_metric_history(found.info.run_id, "eval/pass_at_2")] == [0, 3, 6]
    assert found.data.params["algorithm.name"] == "grpo" and found.data.tags["export/uri"] == export
    assert found.info.status == "FINISHED" and found.info.run_name == "cpu-tiny"  # default: the experiment's name


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
