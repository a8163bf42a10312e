"""Multi-turn episodes: tokens the policy did not write (a tool's output, a user turn) are context,
never trained on; staleness counts the policy's tokens only."""

from __future__ import annotations

import pytest
import torch

from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import tiny_qwen2
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import collate
from kuberl.rollout.types import Trajectory

CONFIG = AlgorithmConfig(name="grpo", group_size=2, behavior_imp_cap=None)
# policy writes 3 tokens, the tool answers with 2 (context), the policy writes 2 more
MASK = [1, 1, 1, 0, 0, 1, 1]


def episode(tool_logprob: float, tool_version: int = 4) -> Trajectory:
    return Trajectory([2, 10, 11, 12], [20, 21, 22, 30, 31, 23, 1],
                      [-1.5, -2.0, -0.5, tool_logprob, tool_logprob, -1.0, -0.2],
                      [4, 4, 4, tool_version, tool_version, 5, 5], reward=1.0, loss_mask=MASK)


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
    actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0)
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


@pytest.mark.slow  # the tool-warmed model is trained once per run (most of a minute on one core)
async def test_a_tool_episode_masks_the_tool_message_and_rewards_the_final_answer(tool_warmed_model):
    """A tiny model warm-started on tool demonstrations, served by the real inference server: its
    episodes call the calculator, the tool's answer sits in them as masked context, and the final
    turn is what the reward judges."""
    from aiohttp.test_utils import TestServer

    from kuberl.agent.workflow import TOOL_MESSAGE, ToolWorkflow
    from kuberl.data.datasets import Example
    from kuberl.inference.engine import TorchEngine
    from kuberl.inference.server import build_app
    from kuberl.models.text import TextCodec
    from kuberl.rewards import exact_match
    from kuberl.rewards.pool import InlineScorer
    from kuberl.rollout.client import InferenceClient
    from kuberl.rollout.evaluation import evaluate
    from kuberl.rollout.workflow import WorkflowContext

    model, tok = tool_warmed_model
    engine = TorchEngine(model.eval(), tok.eos_token_id, tok.pad_token_id, seed=0)
    server = TestServer(build_app(engine, tok, "test-token-0123456789"))
    await server.start_server()
    codec = TextCodec(tok)
    workflow = ToolWorkflow(WorkflowContext(
        encode_prompt=codec.encode_prompt, prompt_text=codec.prompt_text, encode_text=codec.encode_text,
        decode=codec.decode, eos_id=codec.eos_id, reward=InlineScorer(exact_match), tools=("calculator",),
        group_size=8, max_new_tokens=24, max_turns=3, temperature=0.5, top_p=1.0))
    try:
        async with InferenceClient([str(server.make_url("/"))], "test-token-0123456789") as client:
            group = await workflow.run_episode(client, Example("37*12=", "444"), group_id=0)
            evaluation = await evaluate(client, [Example("37*12=", "444"), Example("25*31=", "775")], workflow, 8, 0)
    finally:
        await server.close()
    assert group is not None and len(group.trajectories) == 8
    called = [t for t in group.trajectories if t.info["tool_calls"] == "1"]
    assert len(called) >= 6, [tok.decode(t.output_ids) for t in group.trajectories]
    for t in called:
        mask = t.trained
        start = mask.index(0)
        end = start + mask[start:].index(1) if 1 in mask[start:] else len(mask)
        assert tok.decode(t.output_ids[start:end]) == TOOL_MESSAGE.format("444")  # the calculator's answer
        assert t.behav_logprobs[start:end] == [0.0] * (end - start)
        assert tok.decode(t.output_ids[:start]) == "calc(37*12)"  # the turn ends at the call
        assert t.reward == float(tok.decode(t.output_ids[end:]).removesuffix("<eos>").strip() == "444")
    assert sum(t.reward for t in called) >= 4  # the warm start copies the tool's answer most of the time
    # evaluation runs the same multi-turn episodes: lengths count the policy's tokens (call + answer)
    assert evaluation.prompts == 2 and 0 < evaluation.reward <= evaluation.pass_at_k <= 1
    assert evaluation.length >= len("calc(37*12)") + len("444")
