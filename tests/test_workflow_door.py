"""``spec.rollout.workflow``: a team's own episode logic, named in the manifest ('module:Name') and built
from a :class:`~kuberl.rollout.workflow.WorkflowContext` — refused by ``kuberl validate`` naming the field
when it cannot be the user's, and run by ``kuberl run`` (the slow test: examples/workflows/second_try.py,
two turns and its own reward)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl.imports import defines
from kuberl.local import run_local
from kuberl_cli.main import main

from .test_validation import with_spec, write

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "examples" / "workflows"


def test_a_workflow_module_that_is_not_here_is_a_warning(tmp_path, capsys):
    path = write(tmp_path, with_spec(rollout={"workflow": "team_flows.episodes:TwoTurns"}))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "spec.rollout.workflow: 'team_flows.episodes:TwoTurns': no module " in err


def test_a_workflow_its_module_does_not_define_is_refused_naming_the_field(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(WORKFLOWS))
    assert main(["validate", str(write(tmp_path, with_spec(rollout={"workflow": "second_try:SecondTry"})))]) == 0
    assert "spec.rollout.workflow" not in capsys.readouterr().err
    path = write(tmp_path, with_spec(rollout={"workflow": "second_try:SecondTries"}))
    assert main(["validate", str(path)]) == 1
    assert "spec.rollout.workflow: 'second_try:SecondTries': second_try (" in capsys.readouterr().err
    assert main(["validate", "--import-rewards", str(path)]) == 1
    assert "spec.rollout.workflow: 'second_try:SecondTries': second_try defines no 'SecondTries'" \
        in capsys.readouterr().err


@pytest.mark.parametrize(("changes", "message"), [
    ({"rollout": {"workflow": "kuberl.rollout.workflow:RLVRWorkflow"}}, "KubeRL's own workflows are chosen by"),
    ({"rollout": {"workflow": "second_try"}}, "String should match pattern"),
    ({"rollout": {"workflow": "second_try:SecondTry"}, "agent": {"image": "registry.example/agent:1",
                                                                "command": ["python", "agent.py"]}},
     "spec.agent drives every episode, so no workflow runs"),
])
def test_a_workflow_that_cannot_run_is_refused(tmp_path, capsys, changes, message):
    assert main(["validate", str(write(tmp_path, with_spec(**changes)))]) == 1
    err = capsys.readouterr().err
    assert "spec.rollout.workflow" in err and message in err, err


def test_what_a_module_defines_is_read_from_its_source_without_running_it():
    source = ("import os\nfrom a import b as c\nclass K: ...\nasync def f(): ...\nx: int = 1\n"
              "if True:\n    y = 2\ntry:\n    import z\nexcept ImportError:\n    w = 0\n")
    assert all(defines(source, name) for name in ("os", "c", "K", "f", "x", "y", "z", "w"))
    assert defines(source, "b") is False and defines(source, "nope") is False
    assert defines("from m import *\n", "anything") is None  # cannot be told without running it
    assert defines("def __getattr__(name): ...\n", "anything") is None
    assert defines("def (:\n", "x") is None


@pytest.mark.slow
def test_a_users_two_turn_workflow_with_its_own_reward_trains(tmp_path, monkeypatch):
    """``kuberl run`` with ``rollout.workflow: second_try:SecondTry``: every trained group came from it —
    its reward pays 0.25 for two answers that agree on top of the dataset's 0/1 reward, so some steps'
    reward sums are not whole numbers, which no 0/1 reward can give — and the run trains."""
    monkeypatch.setenv("PYTHONPATH", str(WORKFLOWS))  # the processes kuberl run starts inherit it
    steps, batch = 6, 32
    summary = run_local(ROOT / "examples/cpu-tiny.yaml",
                        ["rollout.workflow=second_try:SecondTry", f"algorithm.batchSize={batch}", "evaluation=null"],
                        steps, None, workdir=tmp_path / "run", quiet=True)
    sums = [r * batch for r in summary["rewards"]]
    assert len(sums) == steps
    assert all(abs(4 * s - round(4 * s)) < 0.02 for s in sums), sums  # k + 0.25 m: whole quarters
    assert any(abs(s - round(s)) > 0.2 for s in sums), sums  # some consistency paid: not a 0/1 reward
