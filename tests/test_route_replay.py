"""Routing replay (R3, ``kuberl.models.moe_routing``): the torch engine returns the experts it chose for
every position, they travel with the trajectory, and the trainer's forward routes as the engine did —
padded and packed alike — so a router that disagrees with the engine's no longer changes the log-probs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kuberl.inference.contract import Generation, SamplingParams
from kuberl.inference.engine import TorchEngine, generate_all
from kuberl.models import moe_routing
from kuberl.models.tiny import tiny_qwen3_moe
from kuberl.policy.actor import packed_token_logprobs_and_entropy, token_logprobs_and_entropy
from kuberl.policy.batch import Batch, collate
from kuberl.rollout.types import Trajectory

VOCAB = 40
LAYERS, TOP_K = 2, 2


def own_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[positions, layers, k]: the experts ``model`` chooses at every position of one sequence."""
    with torch.no_grad(), moe_routing.recording(model) as recorded:
        model(input_ids=torch.tensor([ids]))
    return moe_routing.stacked(recorded, LAYERS, 1)[0]


def generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[Generation]:
    engine = TorchEngine(model, eos_id=1, pad_id=0, seed=0)
    return generate_all(engine, prompts, SamplingParams(max_new_tokens=new_tokens, return_routes=True))


def nudged(model: torch.nn.Module, scale: float = 0.05, seed: int = 5) -> torch.nn.Module:
    """A copy whose routers disagree with ``model``'s on some tokens (as an engine's other numerics do)."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routing.routers(other):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=generator))
    return other


def test_the_engine_returns_the_routes_of_every_position_it_computed():
    model = tiny_qwen3_moe(VOCAB, seed=1).eval()
    prompts = [[2, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14], [2, 3]]  # batched together, left-padded
    for prompt, out in zip(prompts, generate(model, prompts, new_tokens=5), strict=True):
        sequence = prompt + out.output_ids
        assert out.routes is not None and out.routes.shape == (len(sequence) - 1, LAYERS, TOP_K)
        # prefill and cached decode steps route as one uncached forward over the sequence does
        assert torch.equal(out.routes, own_routes(model, sequence)[:-1])


def test_routes_cross_the_wire_and_survive_a_resume():
    routes = torch.randint(0, 4, (6, LAYERS, TOP_K), dtype=torch.int16)
    gen = Generation([7, 8], [-0.5, -0.25], [3, 3], "stop", routes=routes)
    back = Generation.from_json(gen.to_json())
    assert torch.equal(back.routes, routes) and back.output_ids == [7, 8]
    assert Generation.from_json(Generation([7], [-1.0], [3], "stop").to_json()).routes is None
    wire = gen.to_json() | {"routes": {"shape": [6, LAYERS, TOP_K], "data": "AAAA"}}
    with pytest.raises(ValueError, match=r"routes\.data holds 3 bytes"):
        Generation.from_json(wire)
    partial = Generation([7], [-0.5], [3], "abort", routes=routes[:4])
    assert torch.equal(partial.then(gen).routes, routes)  # the resumed call routed the whole sequence again


def trajectories(model: torch.nn.Module, engine_model: torch.nn.Module) -> list[Trajectory]:
    prompts = [[2, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14], [2, 3], [2, 20, 21]]
    return [Trajectory(p, g.output_ids, g.logprobs, g.versions, routes=g.routes)
            for p, g in zip(prompts, generate(engine_model, prompts, new_tokens=6), strict=True)]


@pytest.mark.parametrize("scorer", [token_logprobs_and_entropy, packed_token_logprobs_and_entropy])
def test_the_trainer_routes_as_the_engine_did(scorer):
    """An engine whose routers disagree with the trainer's: without the routes the trainer's log-probs
    differ from the engine's; with them the trainer takes the engine's experts at every known position
    (recorded while replaying) and its log-probs move towards the engine's."""
    trainer = tiny_qwen3_moe(VOCAB, seed=1).eval()
    engine = nudged(trainer)
    trajs = trajectories(trainer, engine)
    replayed = collate(trajs, [0.0] * len(trajs), 0)
    plain = collate([Trajectory(t.prompt_ids, t.output_ids, t.behav_logprobs, t.versions) for t in trajs],
                    [0.0] * len(trajs), 0)
    assert plain.routes.shape[2] == 0 and replayed.routes.shape[2:] == (LAYERS, TOP_K)
    with torch.no_grad(), moe_routing.recording(trainer) as chosen:
        with_routes, _ = scorer(trainer, replayed, 1.0)
    with torch.no_grad():
        without, _ = scorer(trainer, plain, 1.0)
    if scorer is token_logprobs_and_entropy:  # the padded forward: its tokens are the batch's [B, L]
        taken = moe_routing.stacked(chosen, LAYERS, replayed.size)
        known = replayed.routes >= 0
        assert known.any() and torch.equal(taken[known], replayed.routes[known].to(taken.dtype))
    mask = replayed.loss_mask > 0
    gap_with = (with_routes - replayed.behav_logp)[mask].abs().mean()
    gap_without = (without - replayed.behav_logp)[mask].abs().mean()
    assert gap_without > 0.01 and gap_with < 0.5 * gap_without


def test_replaying_a_models_own_routes_changes_nothing_and_packing_agrees():
    model = tiny_qwen3_moe(VOCAB, seed=2).eval()
    trajs = trajectories(model, model)
    batch = collate(trajs, [0.0] * len(trajs), 0)
    plain = collate([Trajectory(t.prompt_ids, t.output_ids, t.behav_logprobs, t.versions) for t in trajs],
                    [0.0] * len(trajs), 0)
    with torch.no_grad():
        padded, _ = token_logprobs_and_entropy(model, batch, 1.0)
        packed, _ = packed_token_logprobs_and_entropy(model, batch, 1.0)
        own, _ = token_logprobs_and_entropy(model, plain, 1.0)
    mask = batch.loss_mask > 0
    torch.testing.assert_close(padded[mask], own[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[mask], batch.behav_logp[mask], rtol=1e-4, atol=1e-4)  # the engine's own


def test_a_trajectory_refuses_routes_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"routes must be \[4 positions"):
        Trajectory([2, 3, 4], [5, 6], [-1.0, -1.0], [0, 0], routes=torch.zeros((5, LAYERS, TOP_K), dtype=torch.int16))



def routed_batch() -> Batch:
    """Six random rows for ``test_megatron``'s Qwen3-MoE, carrying the routes a nudged copy of it (its
    routers disagree on some tokens) chooses for them."""
    from .test_megatron import qwen3_moe, random_batch

    model = qwen3_moe()
    batch = random_batch(model.config.vocab_size, seed=6, rows=6)
    engine = nudged(model, scale=0.3)
    with torch.no_grad(), moe_routing.recording(engine) as recorded:
        engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    routes = moe_routing.stacked(recorded, model.config.num_hidden_layers, batch.size)
    routes[batch.attention_mask == 0] = moe_routing.UNKNOWN
    return dataclasses.replace(batch, routes=routes)


def _megatron_logprobs(rank: int, world: int, port: int, layout: str, out: str) -> None:
    """The Megatron actor laid out as ``LAYOUTS[layout]`` reads the log-probs of :func:`routed_batch`
    with its routes and without; one rank of the last pipeline stage saves them."""
    from megatron.core import parallel_state

    from kuberl.collectives import exit_without_teardown
    from kuberl.megatron.cpu import on_device

    from .test_megatron import qwen3_moe
    from .test_megatron_actor import LAYOUTS, gloo_world, make_actor

    with gloo_world(rank, world, port):
        parallel_state.initialize_model_parallel(**LAYOUTS[layout])
        batch = routed_batch()
        actor = make_actor(qwen3_moe, layout)
        with torch.no_grad(), on_device(actor.device):  # as MegatronActor.train_step reads them
            replayed = actor.logprobs(actor.model, [batch])
            own = actor.logprobs(actor.model, [dataclasses.replace(batch, routes=batch.routes[:, :, :0])])
        first = (parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
                 and parallel_state.get_context_parallel_rank() == 0)
        if replayed and first:  # only the last pipeline stage reads them
            torch.save({"replayed": replayed[0], "own": own[0]}, out)
    exit_without_teardown(0)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2-dp2", "cp2"])
def test_megatron_replays_the_routes_as_the_fsdp_path_does(tmp_path, layout):
    """Sequence-parallel token slices (tp2), layers on two stages (pp2), experts on two ranks (ep2) and
    each row's positions split over two ranks (cp2): the routes land on the right token and layer when
    Megatron reads what the HF path reads."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    from .test_megatron import qwen3_moe
    from .workers import FREE_PORT, start_workers

    out = tmp_path / "logprobs.pt"
    start_workers(_megatron_logprobs, 2, (2, FREE_PORT, layout, str(out)))
    got = torch.load(out)
    batch, hf = routed_batch(), qwen3_moe()
    with torch.no_grad():
        replayed, _ = token_logprobs_and_entropy(hf, batch, 0.7)
        own, _ = token_logprobs_and_entropy(hf, dataclasses.replace(batch, routes=batch.routes[:, :, :0]), 0.7)
    mask = batch.loss_mask > 0
    assert (replayed - own)[mask].abs().max() > 1e-2  # the routes change what the model says
    torch.testing.assert_close(got["replayed"][mask], replayed[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["own"][mask], own[mask], atol=1e-5, rtol=1e-5)


def test_a_tool_episode_carries_its_last_generations_routes():
    """Each turn's generation routed the whole episode so far: the trajectory takes the last one's,
    cut to the tokens kept, and −1 where context came after it (the engine never routed it)."""
    from kuberl.agent.workflow import Episode

    prompt = [2, 5, 6]
    episode = Episode()
    first = torch.randint(0, 4, (len(prompt) + 3 - 1, LAYERS, TOP_K), dtype=torch.int16)
    episode.policy([7, 8, 9], [-1.0] * 3, [0] * 3, first)
    episode.context([30, 31])
    last = torch.randint(0, 4, (len(prompt) + 5 + 4 - 1, LAYERS, TOP_K), dtype=torch.int16)
    episode.policy([10, 11], [-1.0] * 2, [1] * 2, last)  # the turn was cut after 2 of its 4 tokens
    assert torch.equal(episode.routes_of(prompt), last[:len(prompt) + 7 - 1])
    episode.context([32, 33, 34])  # a tool's answer, then the episode ran out of turns
    routes = episode.routes_of(prompt)
    trajectory = Trajectory(prompt, episode.output_ids, episode.logprobs, episode.versions, routes=routes)
    assert torch.equal(trajectory.routes[:len(prompt) + 7], last[:len(prompt) + 7])
    assert (trajectory.routes[len(prompt) + 7:] == moe_routing.UNKNOWN).all()
