"""spec.trainer.distributedOptimizer on the Megatron actor (ZeRO-1, kuberl.megatron.optimizer): data-
parallel ranks each keep their share of AdamW's state (a mixture's experts shared over the ranks that
hold the same experts), take exactly AdamW's steps, and their checkpoint resumes unsharded in another
layout (tensor parallelism 2) and sharded again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl.collectives import all_gather, exit_without_teardown
from kuberl.megatron.optimizer import state_bytes
from kuberl.policy.batch import split

from .test_megatron import make_actor, random_batch
from .test_megatron_actor import LAYOUTS, MODELS_TRAINED, as_collated_alone, gloo_world
from .workers import FREE_PORT, start_workers

ALL_DATA_PARALLEL = "dp"  # no model parallelism: every rank data-parallel


def _run(rank: int, world: int, port: int, model: str, layout: str, distributed: bool, staging: str, resume: bool,
         out: str) -> None:
    """Two steps (or, ``resume``, the second from the checkpoint in ``staging``) of the Megatron actor
    laid out as ``layout`` over ``world`` ranks; rank 0 saves the weights and each rank's optimizer bytes."""
    from megatron.core import parallel_state

    from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer

    with gloo_world(rank, world, port):
        parallel_state.initialize_model_parallel(**LAYOUTS.get(layout, {}))
        make = MODELS_TRAINED[model]
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
        result["update_size"] = actor.train_step(mine[1], batches[1].size)["ppo_actor/update_size"]
        result["state"] = actor.full_state_dict()
        if rank == 0:
            torch.save(result, out)
    exit_without_teardown(0)


def run(tmp_path: Path, name: str, model: str, layout: str, world: int, distributed: bool, staging: str,
        resume: bool = False) -> dict[str, Any]:
    out = tmp_path / f"{name}.pt"
    start_workers(_run, world, (world, FREE_PORT, model, layout, distributed, str(tmp_path / staging), resume,
                                str(out)))
    return torch.load(out)


@pytest.mark.parametrize(("model", "layout", "world", "share"), [
    ("qwen2", ALL_DATA_PARALLEL, 2, 1 / 2),  # every parameter over 2 data-parallel ranks
    ("qwen3-moe", "ep2-dp2", 4, 0.35),  # dense layers (60 %) over 4 ranks, each expert (40 %) over the 2 holding it
])  # fmt: skip
@pytest.mark.slow
def test_data_parallel_ranks_keep_their_share_take_adamws_steps_and_resume_in_any_layout(tmp_path, model, layout,
                                                                                          world, share):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    plain = run(tmp_path, "plain", model, layout, world, False, "plain-ckpt")
    sharded = run(tmp_path, "sharded", model, layout, world, True, "sharded-ckpt")
    print(model, "optimizer bytes per rank: plain", plain["optimizer_bytes"], "sharded", sharded["optimizer_bytes"])
    parameters = sum(p.numel() for p in MODELS_TRAINED[model]().parameters())  # tied ones once
    assert sum(sharded["optimizer_bytes"]) == 2 * 4 * parameters  # two float32 moments, each on one rank
    assert max(sharded["optimizer_bytes"]) <= 1.2 * share * max(plain["optimizer_bytes"])  # ≈ share each
    for name, tensor in plain["state"].items():  # the same AdamW update, only stepped by its owner
        assert torch.equal(sharded["state"][name], tensor), name
    # ‖Δθ‖ / ‖θ‖ of the second step: each piece counted once whoever owns its moments (read back from them)
    after, before = (torch.cat([t.flatten() for t in s.values()]) for s in (plain["state"], plain["after_first"]))
    assert plain["update_size"] == pytest.approx(float((after - before).norm() / after.norm()), rel=1e-3)
    assert sharded["update_size"] == pytest.approx(plain["update_size"], rel=1e-5)

    unsharded = run(tmp_path, "unsharded", model, "tp2", 2, False, "sharded-ckpt", resume=True)  # another layout
    again = run(tmp_path, "again", model, layout, world, True, "sharded-ckpt", resume=True)
    assert again["optimizer_bytes"] == sharded["optimizer_bytes"]
    start = sharded["after_first"]
    for name, weights in sharded["state"].items():
        assert torch.equal(again["state"][name], weights), name  # exactly the uninterrupted second step
        change, other = weights - start[name], unsharded["state"][name] - start[name]
        assert change.norm() > 0 and (other - change).norm() <= 1e-2 * change.norm(), name  # tp2's sums differ
