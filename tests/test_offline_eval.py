"""``kuberl eval``: an export's pass@k and mean reward, offline, through the engine, prompt rendering
and reward training uses — equal to the run's own held-out evaluation of the same weights."""

from __future__ import annotations

import json
from pathlib import Path

from kuberl.local import run_local
from kuberl_cli.main import main

from .conftest import ROOT

EXAMPLE = ROOT / "examples/cpu-tiny.yaml"


def test_kuberl_eval_of_a_runs_export_equals_the_runs_final_evaluation(tmp_path: Path, capfd):
    """A short run of the main example evaluates greedily (one sample of 64 prompts: no sampling noise)
    after its last step and exports that policy in float32; ``kuberl eval`` of the export, with the
    example's data, reward and rendering (-f), gives the same reward."""
    steps = 6
    summary = run_local(EXAMPLE, ["model.sftWarmup.steps=20", f"evaluation.everySteps={steps}",
                                  "evaluation.temperature=0", "evaluation.samplesPerPrompt=1", "export.dtype=float32"],
                        steps, None, workdir=tmp_path / "run", quiet=True)
    final = summary["eval"][-1]
    assert final["step"] == final["version"] == steps and summary["export"]["step"] == steps
    assert 0.05 < final["reward"] < 0.95  # neither all right nor all wrong: a difference would show
    capfd.readouterr()
    assert main(["eval", summary["export"]["uri"], "-f", str(EXAMPLE), "--temperature", "0", "--samples", "1"]) == 0
    offline = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert offline["prompts"] == 64 and offline["samples_per_prompt"] == 1 and offline["temperature"] == 0
    assert offline["reward"] == final["reward"], (offline, final)
    assert offline["pass@1"] == final["pass@1"]

    fresh = main(["eval", "builtin:tiny-qwen2", "-f", str(EXAMPLE), "--temperature", "0", "--samples", "1"])
    assert fresh == 0  # the base model, same data: what the run's training changed
    assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["reward"] != final["reward"]


def test_kuberl_eval_says_what_it_needs_and_names_a_bad_field(capfd):
    assert main(["eval", "builtin:tiny-qwen2", "--data", "builtin:arithmetic"]) == 1
    assert "--reward" in capfd.readouterr().err
    assert main(["eval", "builtin:tiny-qwen2", "--data", "builtin:arithmetic", "--reward",
                 "kuberl.rewards:exact_match", "--samples", "0"]) == 1
    assert "spec.evaluation.samplesPerPrompt" in capfd.readouterr().err
    assert main(["eval", "Qwen/Qwen3-8B", "--data", "builtin:arithmetic", "--reward", "kuberl.rewards:math"]) == 1
    assert "hf://Qwen/Qwen3-8B" in capfd.readouterr().err  # a bare hub id gets the hf:// hint
