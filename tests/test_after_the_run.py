"""What a run leaves for the team, from one short run: its export, which ``kuberl eval`` scores as the
run's own held-out evaluation did (the same engine, rendering and reward), and its curves on W&B
(offline, read back with wandb's own reader) and MLflow (a file store, read back with MlflowClient)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kuberl.local import run_local
from kuberl_cli.main import main

from .conftest import ROOT
from .test_tracking import wandb_records

EXAMPLE = ROOT / "examples/cpu-tiny.yaml"


@pytest.mark.slow
def test_a_runs_export_scores_offline_as_in_the_run_and_its_curves_reach_wandb_and_mlflow(tmp_path: Path, capfd,
                                                                                           monkeypatch):
    """A short run of the main example evaluates greedily (one sample of 64 prompts: no sampling noise)
    at steps 0, 3 and 6, exports its final policy in float32 and logs to W&B (offline) and MLflow (a
    file store). ``kuberl eval`` of the export, with the example's data, reward and rendering (-f),
    gives the run's final evaluation exactly; both trackers hold the run's reward curve, its
    evaluations, its spec and the export's URI."""
    pytest.importorskip("wandb", reason="the tracking extra is not installed (the dev extra installs it)")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    steps, store = 6, f"file://{tmp_path}/mlruns"
    summary = run_local(EXAMPLE, [
        "model.sftWarmup.steps=20", "evaluation.everySteps=3", "evaluation.temperature=0",
        "evaluation.samplesPerPrompt=1", "export.dtype=float32", "logging.wandb.project=kuberl-tests",
        "logging.wandb.mode=offline", "logging.wandb.tags=[ci]", f"logging.mlflow.trackingUri={store}",
        "logging.mlflow.experiment=kuberl-tests"], steps, None, workdir=tmp_path / "run", quiet=True)
    final, rewards, export = summary["eval"][-1], summary["rewards"], summary["export"]["uri"]
    assert final["step"] == final["version"] == steps and summary["export"]["step"] == steps
    assert 0.05 < final["reward"] < 0.95  # neither all right nor all wrong: a difference would show
    capfd.readouterr()
    assert main(["eval", export, "-f", str(EXAMPLE), "--temperature", "0", "--samples", "1"]) == 0
    offline = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert offline["prompts"] == 64 and offline["samples_per_prompt"] == 1 and offline["temperature"] == 0
    assert offline["reward"] == final["reward"], (offline, final)
    assert offline["pass@1"] == final["pass@1"]
    fresh = main(["eval", "builtin:tiny-qwen2", "-f", str(EXAMPLE), "--temperature", "0", "--samples", "1"])
    assert fresh == 0  # the base model, same data: what the run's training changed
    assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["reward"] != final["reward"]

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
    evals = client.get_metric_history(found.info.run_id, "eval/pass_at_1")
    assert [m.step for m in evals] == [0, 3, 6] and round(evals[-1].value, 4) == final["pass@1"]
    assert found.data.params["algorithm.name"] == "grpo" and found.data.tags["export/uri"] == export
    assert found.info.status == "FINISHED" and found.info.run_name == "cpu-tiny"  # default: the experiment's name


def test_kuberl_eval_says_what_it_needs_and_names_a_bad_field(capfd):
    assert main(["eval", "builtin:tiny-qwen2", "--data", "builtin:arithmetic"]) == 1
    assert "--reward" in capfd.readouterr().err
    assert main(["eval", "builtin:tiny-qwen2", "--data", "builtin:arithmetic", "--reward",
                 "kuberl.rewards:exact_match", "--samples", "0"]) == 1
    assert "spec.evaluation.samplesPerPrompt" in capfd.readouterr().err
    assert main(["eval", "Qwen/Qwen3-8B", "--data", "builtin:arithmetic", "--reward", "kuberl.rewards:math"]) == 1
    assert "hf://Qwen/Qwen3-8B" in capfd.readouterr().err  # a bare hub id gets the hf:// hint
