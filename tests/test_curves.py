"""Seeing training: held-out evaluation, TensorBoard events (read back with TensorBoard's own
reader) and a progress display that prints plain short lines when it is not on a terminal."""

from __future__ import annotations

import io
import json
import subprocess

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from kuberl.api import Progress
from kuberl.display import ProgressDisplay, plain_line

from . import reference
from .conftest import ROOT
from .run_processes import processes_mentioning


def progress(step: int, **extra) -> Progress:
    """A trainer's /progress reply as ``kuberl run`` reads it."""
    reply = {"step": step, "maxSteps": 500, "reward": 0.5, "observedStaleness": 2, "tokensPerSecond": 2950.0,
             "firstStep": 0, **extra}
    parsed = Progress.from_reply(reply)
    assert parsed is not None
    return parsed


def test_plain_lines_are_short_and_carry_eta_and_evaluation():
    line = plain_line(progress(120, evalReward=0.61), elapsed=30.0)
    assert "\r" not in line and len(line) < 200
    assert "step 120/500 (24%)" in line and "eval 0.610" in line and "eta 0:01:35" in line
    hostile = plain_line(progress(10**12, reward=float("nan"), observedStaleness=10**30, tokensPerSecond=1e300), 1e9)
    assert len(hostile) < 200


class FakeClock:
    """A monotonic clock under the test's control; it starts where a host booted a moment ago would."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_display_that_is_not_a_terminal_prints_one_line_per_update_at_most_every_interval():
    clock = FakeClock(0.0)  # time.monotonic() on a host booted less than `interval` ago
    stream = io.StringIO()
    display = ProgressDisplay(stream, interval=10, clock=clock)
    for step in range(1, 50):
        display.update(progress(step))
        clock.now += 0.1  # 49 updates within 4.9 s: only the first is due
    display.close()  # the last update shows when the run ends
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("kuberl run: step 1/500") and "step 49/500" in lines[1]


def test_a_display_prints_again_once_the_interval_has_passed_and_never_repeats_an_update():
    clock = FakeClock(5.0)
    stream = io.StringIO()
    display = ProgressDisplay(stream, interval=10, clock=clock)
    display.update(progress(1))
    clock.now += 9.9
    display.update(progress(2))  # not due yet
    clock.now += 0.1
    display.update(progress(3))  # 10 s after the first line
    clock.now += 60
    display.update(progress(3))  # the same update again: nothing new to say
    display.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[3] for line in lines] == ["1/500", "3/500"], lines
    assert "elapsed 0:00:10" in lines[1]


@pytest.mark.slow
def test_the_cpu_example_learns_within_the_staleness_bound_evaluates_and_logs_curves_and_plain_lines(tmp_path):
    """The README's main job, shortened (120 steps, :mod:`.reference`) through the CLI in a pipe: its
    training-reward and evaluation curve lies inside the seeds' reference band (tests/reference/cpu_tiny.json:
    a change that moves the curve fails with a table of the points outside), per-token versions never exceed
    η = 2 (and the run is asynchronous), held-out evaluations at 0/60/120 each of one policy version and
    recorded by the next step, TensorBoard curves, plain
    progress lines, no process left."""
    work = tmp_path / "run"
    done = subprocess.run(reference.command(work, tmp_path / "summary.json"),  # 1,024 samples per evaluation
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    evals = summary["eval"]
    assert [e["step"] for e in evals] == [0, 60, 120] and summary["eval_skipped"] == []
    assert [(e["version"], e["version_span"]) for e in evals] == [(0, 1), (60, 1), (120, 1)]  # one policy each
    assert [e["reported_after_step"] for e in evals] == [1, 61, 120]  # the next step holds its update for it
    assert all(0 <= e["pass@16"] <= 1 and e["pass@16"] >= e["reward"] - 1e-9 for e in evals)

    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/reward", "eval/reward", "eval/pass@16", "ppo_actor/loss", "ppo_actor/entropy",
            "rollout/observed_staleness", "timeperf/step"} <= scalars, scalars
    entropies = [e.value for e in events.Scalars("ppo_actor/entropy")]
    learning_rates = [e.value for e in events.Scalars("ppo_actor/learning_rate")]  # the example's cosine schedule
    warmup = yaml.safe_load((ROOT / "examples/cpu-tiny.yaml").read_text())["spec"]["algorithm"]["warmupSteps"]
    assert learning_rates[0] == pytest.approx(3e-4 / warmup) and learning_rates[warmup - 1] == pytest.approx(3e-4)
    assert learning_rates[:warmup] == sorted(learning_rates[:warmup])  # the warm-up ramp, then the cosine's fall
    assert learning_rates[warmup - 1:] == sorted(learning_rates[warmup - 1:], reverse=True)
    assert learning_rates[-1] < 0.15 * 3e-4
    per_step = json.loads((tmp_path / "summary.json").read_text())  # stdout leaves per-step lists out
    rewards = per_step["rewards"]
    assert per_step["steps"] == len(rewards) == per_step["final_version"] == reference.STEPS
    compared = reference.compare(reference.curve(per_step), reference.load())
    assert all(p.inside for p in compared), "the curve left its reference band:\n" + reference.table(compared)
    assert 0 < summary["max_token_staleness_trained"]  # asynchronous; beyond η = 2 only in groups counted late:
    assert summary["max_token_staleness_trained"] <= 2 or summary["late_groups_trained"] > 0
    assert summary["trained_tokens_per_second"] > 0
    pushes = summary["weight_pushes"]  # every version v0 … v120 over p2p, none fell back (the one replica: no slowest)
    assert pushes["by_mode"] == {"p2p": 121} and pushes["fell_back"] == pushes["slow_replica"] == 0
    assert pushes["last"]["bytesPerReplica"] == summary["weight_update_bytes"] and pushes["last"]["version"] == 120
    assert processes_mentioning(str(work)) == []
    # TensorBoard keeps float32 and the summary rounds the float64 to 4 places: equal within that rounding
    assert len(entropies) == 120 and per_step["entropies"] == pytest.approx(entropies, abs=5.1e-5)
    assert 0 < summary["entropy_last10_mean"] < summary["entropy_first10_mean"]  # learning sharpens the policy
    assert [e.step for e in events.Scalars("eval/reward")] == [0, 60, 120]
    assert len(events.Scalars("train/reward")) == 120
    assert summary["tensorboard"] == str(work / "tensorboard")
    export = work / "checkpoints" / "hf" / "step-00000120"  # spec.export: the final policy, from_pretrained-ready
    assert summary["export"]["uri"] == f"file://{export}/" and (export / "MANIFEST.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(export)
    assert exported.dtype == torch.bfloat16 and exported.config.vocab_size == len(AutoTokenizer.from_pretrained(export))

    lines = done.stderr.splitlines()
    updates = [line for line in lines if line.startswith("kuberl run: step ")]
    assert "\r" not in done.stderr and len(updates) >= 2 and all(len(line) < 200 for line in updates), lines
    final = f"kuberl run: step 120/120 (100%) reward {per_step['rewards'][-1]:.3f} eval {evals[-1]['reward']:.3f} "
    assert updates[-1].startswith(final), updates[-1]  # where the run ended, though the trainer is gone
    assert any("checkpoints to file://" in line for line in lines)
    assert any(f"training curves in {work / 'tensorboard'}" in line for line in lines)
    assert any(f"as a Hugging Face model: file://{export}/" in line for line in lines)
