"""Multi-turn episodes: tokens the policy did not write (a tool's output, a user turn) are context,
never trained on; staleness counts the policy's tokens only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from kuberl.local import free_port
from kuberl.models.tiny import tiny_qwen2
from kuberl.rollout.types import Trajectory
from kuberl.trainer.actor import Actor
from kuberl.trainer.algorithms import AlgorithmConfig
from kuberl.trainer.batch import collate

CONFIG = AlgorithmConfig(name="grpo", group_size=2, behavior_imp_cap=None)
# policy writes 3 tokens, the tool answers with 2 (context), the policy writes 2 more
MASK = [1, 1, 1, 0, 0, 1, 1]


def episode(tool_logprob: float, tool_version: int = 4) -> Trajectory:
    return Trajectory([2, 10, 11, 12], [20, 21, 22, 30, 31, 23, 1],
                      [-1.5, -2.0, -0.5, tool_logprob, tool_logprob, -1.0, -0.2],
                      [4, 4, 4, tool_version, tool_version, 5, 5], reward=1.0, loss_mask=MASK)


@pytest.fixture(scope="module")
def world_of_one():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_loss_mask_lands_on_the_tokens_the_policy_wrote():
    batch = collate([episode(0.0)], [1.0], pad_id=0, version=5)
    prompt = 4
    assert batch.loss_mask[0, prompt - 1:prompt - 1 + len(MASK)].tolist() == MASK
    assert batch.fresh_mask[0, prompt - 1:prompt - 1 + len(MASK)].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert episode(0.0, tool_version=0).oldest_version == 4  # a context token's version is not staleness
    assert episode(0.0).trained_tokens == 5
    with pytest.raises(ValueError, match="same length"):
        Trajectory([2], [5, 6], [0.0, 0.0], [0, 0], loss_mask=[1])


def updated_weights(tool_logprob: float, mask: list[int] | None = MASK) -> dict[str, torch.Tensor]:
    actor = Actor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
    trajs = [episode(tool_logprob), Trajectory([2, 13, 14], [24, 25, 1], [-1.0, -1.2, -0.3], [5, 5, 5], 0.0)]
    if mask is None:
        trajs[0].loss_mask = None
    actor.train_step(collate(trajs, [1.0, -1.0], pad_id=0, version=5), len(trajs))
    return {k: v.clone() for k, v in actor.full_state_dict().items()}


def test_tool_output_tokens_are_never_trained_on(world_of_one):
    """What the engine said about the tool's tokens (their behaviour log-probs) cannot change the
    update: those tokens are outside the loss. With the mask gone, it does."""
    a, b = updated_weights(0.0), updated_weights(-30.0)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    unmasked_a, unmasked_b = updated_weights(0.0, mask=None), updated_weights(-30.0, mask=None)
    assert any(not torch.equal(unmasked_a[n], unmasked_b[n]) for n in unmasked_a)
