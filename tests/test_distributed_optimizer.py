"""spec.trainer.distributedOptimizer on the Megatron actor (ZeRO-1, kuberl.megatron.optimizer): two
data-parallel ranks each keep about half of AdamW's state, take exactly AdamW's steps, and their
checkpoint resumes unsharded in another layout (tensor parallelism 2) and sharded again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl.collectives import all_gather, exit_without_teardown
from kuberl.local_processes import free_port
from kuberl.megatron.optimizer import state_bytes
from kuberl.policy.batch import split

from .test_megatron import make_actor, qwen2, random_batch
from .test_megatron_actor import LAYOUTS, MODELS_TRAINED, as_collated_alone, gloo_world
from .workers import start_workers

DP2 = {}  # two ranks, no model parallelism: both data-parallel


def _run(rank: int, world: int, port: int, layout: str, distributed: bool, staging: str, resume: bool,
         out: str) -> None:
    """Two steps (or, ``resume``, the second from the checkpoint in ``staging``) of the Megatron actor
    laid out as ``layout`` over ``world`` ranks; rank 0 saves the weights and each rank's optimizer bytes."""
    from megatron.core import parallel_state

    from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer

    with gloo_world(rank, world, port):
        parallel_state.initialize_model_parallel(**(LAYOUTS[layout] if layout != "dp2" else DP2))
        make = MODELS_TRAINED["qwen2"]
        batches = [random_batch(make().config.vocab_size, seed=s, rows=6) for s in (6, 7)]
        actor = make_actor(make, layout, distributed_optimizer=distributed)
        data_rank, data_ranks = actor.data_parallel()
        mine = [as_collated_alone(split(b, data_ranks)[data_rank]) for b in batches]
        result: dict[str, Any] = {}
        if resume:
            assert load_trainer(actor, Path(staging)).step == 1
        else:
            actor.train_step(mine[0], batches[0].size)
            save_trainer(actor, TrainerState.capture(1, 1, 0), Path(staging))
            result["after_first"] = actor.full_state_dict()
        result["optimizer_bytes"] = all_gather(state_bytes(actor.optimizer))
        actor.train_step(mine[1], batches[1].size)
        result["state"] = actor.full_state_dict()
        if rank == 0:
            torch.save(result, out)
    exit_without_teardown(0)


def run(tmp_path: Path, name: str, layout: str, distributed: bool, staging: str, resume: bool = False
        ) -> dict[str, Any]:
    out = tmp_path / f"{name}.pt"
    start_workers(_run, 2, (2, free_port(), layout, distributed, str(tmp_path / staging), resume, str(out)))
    return torch.load(out)


def test_two_data_parallel_ranks_keep_half_the_state_take_adamws_steps_and_resume_in_any_layout(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    plain = run(tmp_path, "plain", "dp2", False, "plain-ckpt")
    sharded = run(tmp_path, "sharded", "dp2", True, "sharded-ckpt")
    whole = plain["optimizer_bytes"][0]
    parameters = sum(t.numel() for t in qwen2(tied=False).state_dict().values())
    assert plain["optimizer_bytes"] == [whole, whole] and whole == 2 * 4 * parameters  # two float32 moments
    print("optimizer bytes per rank: plain", plain["optimizer_bytes"], "sharded", sharded["optimizer_bytes"])
    assert sum(sharded["optimizer_bytes"]) == whole  # every moment kept once, on one rank
    assert max(sharded["optimizer_bytes"]) <= 0.6 * whole, sharded["optimizer_bytes"]  # ≈ half each
    for name, tensor in plain["state"].items():  # the same AdamW update, only stepped by its owner
        assert torch.equal(sharded["state"][name], tensor), name

    unsharded = run(tmp_path, "unsharded", "tp2", False, "sharded-ckpt", resume=True)  # another layout
    again = run(tmp_path, "again", "dp2", True, "sharded-ckpt", resume=True)
    assert again["optimizer_bytes"] == sharded["optimizer_bytes"]
    start = sharded["after_first"]
    for name, weights in sharded["state"].items():
        assert torch.equal(again["state"][name], weights), name  # exactly the uninterrupted second step
        change, other = weights - start[name], unsharded["state"][name] - start[name]
        assert change.norm() > 0 and (other - change).norm() <= 1e-2 * change.norm(), name  # tp2's sums differ
