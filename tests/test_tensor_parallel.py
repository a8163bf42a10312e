"""A torch-engine replica over two processes (tensor parallel 2, gloo) serves the policy a single
process serves: the same greedy answers and log-probs from the same weights, before and after an update
that only the leader receives; and ``kuberl run`` with such replicas learns as with one-process ones."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest
import torch

from kuberl.inference.contract import SamplingParams
from kuberl.inference.engine import TorchEngine
from kuberl.inference.step_runner import StepRunner
from kuberl.inference.tensor_parallel import ReplicaGroup, TensorParallelRunner, follow, shard_model, tp_problem
from kuberl.models.tiny import char_tokenizer, tiny_qwen2

from . import reference
from .run_processes import processes_mentioning, replica_pid
from .test_local_run import NO_EVAL, _background_run, _wait_for_log
from .workers import FREE_PORT, start_workers

PROMPTS = ["1+2=", "3+4=", "12+30=", "9+9+9="]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def serve_and_update(engine: TorchEngine, update: dict[str, torch.Tensor]) -> dict[str, object]:
    """Greedy answers from the engine's weights, then from ``update`` (loaded as the trainer's would be),
    in one life of the engine (its stop tells a replica's workers to stop too)."""
    tok = char_tokenizer()
    prompts = [[tok.bos_token_id, *tok(p, add_special_tokens=False).input_ids] for p in PROMPTS]

    async def answers() -> list[dict[str, list[float] | list[int]]]:
        done = await asyncio.gather(*(engine.generate(prompt, GREEDY) for prompt in prompts))
        return [{"ids": g.output_ids, "logprobs": g.logprobs} for g in done]

    async def run() -> dict[str, object]:
        engine.start()
        try:
            before = await answers()
            await engine.load_weights(update, 1)
            return {"before": before, "after": await answers()}
        finally:
            await engine.stop()

    return asyncio.run(run())


def _replica_rank(rank: int, port: int, out: str) -> None:
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    group = ReplicaGroup.join(f"127.0.0.1:{port}", rank, 2)
    shard_model(model, group.mesh)
    if rank == 0:
        runner = TensorParallelRunner(model, tok.pad_token_id, group)
        engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0, runner=runner)
        result = serve_and_update(engine, tiny_qwen2(len(tok), seed=1).state_dict())
        result["local_q_rows"] = int(model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0])
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        follow(StepRunner(model, tok.pad_token_id), group)


@pytest.mark.slow
def test_a_two_process_replica_answers_as_one_process_does_before_and_after_an_update(tmp_path):
    out = tmp_path / "replica.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_workers(_replica_rank, 2, (FREE_PORT, str(out)))
    split = json.loads(out.read_text())
    tok = char_tokenizer()
    single = serve_and_update(TorchEngine(tiny_qwen2(len(tok), seed=0), tok.eos_token_id, tok.pad_token_id, seed=0),
                              tiny_qwen2(len(tok), seed=1).state_dict())
    assert split["local_q_rows"] == 64  # each rank holds half of the 128 query rows
    for when in ("before", "after"):
        for mine, theirs in zip(split[when], single[when], strict=True):
            assert mine["ids"] == theirs["ids"], when
            assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-4), when
    assert split["before"] != split["after"]  # the update reached the workers' shards too


def test_which_splits_a_model_allows():
    config = tiny_qwen2(len(char_tokenizer()), seed=0).config  # 4 heads, 2 key-value heads, MLP 256
    assert tp_problem(config, 2) is None
    assert tp_problem(config, 4) == "num_key_value_heads 2 not divisible by 4 ranks"
    assert tp_problem(config, 3) == ("num_attention_heads 4, num_key_value_heads 2, intermediate_size 256 not "
                                     "divisible by 3 ranks")
    config.base_model_tp_plan = {}
    assert "no tensor-parallel plan" in (tp_problem(config, 2) or "")
    config.base_model_tp_plan = {"layers.*.mlp.experts": "moe_tp_experts"}
    assert "splits ['colwise', 'rowwise'] layers only" in (tp_problem(config, 2) or "")


@pytest.mark.slow
def test_kuberl_run_with_two_process_replicas_learns_inside_its_reference_band(tmp_path):
    """The reference run (tests/reference.py) with every replica split over two processes: the curve stays
    inside the band of that variant's own repeats (a two-process replica generates several times slower
    on these cores, so other policy versions sample each step than in the one-process runs: its curve
    lies within the one-process curve's seed spread, not inside its repeats' band), and the engine's
    log-probs of tokens sampled by the weights being trained equal the trainer's (the replica serves the
    trainer's policy)."""
    work = tmp_path / "run"
    split = reference.VARIANTS["tensor-parallel-2"]
    done = subprocess.run(reference.command(work, tmp_path / "summary.json", split), capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    compared = reference.compare(reference.curve(summary), reference.load("tensor-parallel-2"))
    assert all(p.inside for p in compared), "the curve left its reference band:\n" + reference.table(compared)
    assert summary["behav_logp_gap_max"] < 1e-3 and summary["restarts"]["inference"] == 0
    assert "rank 1 of 2 follows its leader" in (work / "inference-0-1.log").read_text()


@pytest.mark.slow
def test_a_killed_worker_restarts_its_whole_replica_and_training_goes_on(tmp_path):
    """Kill the second process of the only replica: its leader is stopped with it, both start again and
    meet anew, the replica is back with the newest weights, and the trainer never restarts; every prompt
    is trained exactly once."""
    work, summary = tmp_path / "run", tmp_path / "summary.json"
    sets = ["inference.tensorParallel=2", "inference.acceleratorsPerNode=1", "model.sftWarmup.steps=5",
            "weightSync.mode=broadcast", NO_EVAL]
    with _background_run(work, summary, 20, sets) as proc:
        _wait_for_log(proc, work / "trainer-0.log", "step 3/20")
        trainer_log, worker_log = (len((work / name).read_text(errors="replace"))
                                   for name in ("trainer-0.log", "inference-0-1.log"))
        os.kill(replica_pid(work, 0, host=1), signal.SIGKILL)
        _wait_for_log(proc, work / "inference-0-1.log", "follows its leader", after=worker_log)  # met anew
        _wait_for_log(proc, work / "trainer-0.log", "is back with the newest weights", after=trainer_log)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    result = json.loads(summary.read_text())
    assert result["restarts"] == {"trainer": 0, "inference": 1, "agent": 0} and result["final_version"] == 20
    prompts = result["prompts"]
    assert prompts["skipped"] == 0 and prompts["trained"] == 20 * 16
    assert prompts["trained"] + prompts["pending"] == prompts["cursor"]
    assert result["behav_logp_gap_max"] < 1e-3  # the restarted replica serves the trainer's policy
    assert processes_mentioning(str(work)) == []
