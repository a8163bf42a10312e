"""vLLM serves the trainer's policy: the same outputs as the torch engine and the trainer's own
log-probs, for a tied and an untied model, before and after weight updates over every sync path.

Compared, for the same weights and prompts:

- greedy continuations of vLLM and of the torch engine are the same tokens;
- the log-prob vLLM reports for each sampled token (temperature 1 and 0.7) equals the trainer's
  recomputation (:func:`kuberl.policy.actor.token_logprobs` over a collated batch) within
  ``TOLERANCE``; so do the torch engine's for its own samples.

Each update perturbs every parameter (a tied output layer with its embedding) and reaches the
engines in the form its sync mode delivers it: ``broadcast`` (safetensors bytes of the full state
dict, both names of a tied tensor), ``disk`` (the file DiskSync writes) and ``p2p`` (the staging dict
of the replica's receiver: one tensor per parameter, tied ones under one name only). The p2p form
is the one that left vLLM's tied output layer on its first weights (issue 12): the reported
log-probs were ≈ 10 nats off after a 0.5-sized perturbation, 0.33 nats after a 0.05 one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from kuberl.inference.contract import Generation, SamplingParams
from kuberl.inference.engine import TorchEngine
from kuberl.inference.vllm_engine import VLLMEngine, build_vllm_engine, hf_parameter_layout, tied_aliases
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.policy.actor import token_logprobs
from kuberl.policy.batch import collate
from kuberl.rollout.types import Trajectory
from kuberl.weights.sync import DiskSync, to_safetensors

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv (scripts/setup --vllm)")

TOLERANCE = 1e-3  # nats, largest per-token difference, float32 on both sides (measured: ≤ 2e-4)
PROMPTS = [[2, 10, 15, 4, 11, 22], [2, 13, 14, 4, 19, 18, 12], [2, 7, 7, 7]]


class Twins:
    """One HF model (the trainer's weights), a vLLM engine and a torch engine serving it, on one loop."""

    def __init__(self, model: torch.nn.Module, vllm_engine: VLLMEngine, torch_engine: TorchEngine,
                 loop: asyncio.AbstractEventLoop):
        self.model, self.vllm, self.torch, self.loop = model, vllm_engine, torch_engine, loop

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def generate(self, engine: Any, params: SamplingParams, copies: int) -> list[tuple[list[int], Generation]]:
        async def all_of() -> list[Generation]:
            return list(await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS for _ in range(copies))))

        gens = self.run(all_of())
        return [(p, g) for p, g in zip([p for p in PROMPTS for _ in range(copies)], gens, strict=True)]


@pytest.fixture(scope="module", params=["tied", "untied"])
def twins(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Twins]:
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), seed=11, tied=request.param == "tied").eval()
    assert bool(tied_aliases(model)) == (request.param == "tied")
    model_dir = tmp_path_factory.mktemp(f"model-{request.param}")
    model.save_pretrained(model_dir)
    served = tiny_qwen2(len(tokenizer), seed=11, tied=request.param == "tied")
    loop = asyncio.new_event_loop()

    async def build() -> tuple[VLLMEngine, TorchEngine]:
        engine = build_vllm_engine(str(model_dir), tokenizer.eos_token_id, hf_parameter_layout(model),
                                   tied_aliases(model), seed=0, dtype="float32", eager=True, max_model_len=256,
                                   cpu_kv_cache_gib=1)  # fmt: skip
        reference = TorchEngine(served, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
        reference.start()
        return engine, reference

    vllm_engine, torch_engine = loop.run_until_complete(build())
    try:
        yield Twins(model, vllm_engine, torch_engine, loop)
    finally:
        loop.run_until_complete(vllm_engine.stop())
        loop.run_until_complete(torch_engine.stop())
        loop.close()


def trainer_logprobs(model: torch.nn.Module, samples: list[tuple[list[int], Generation]],
                     temperature: float) -> list[torch.Tensor]:
    """The trainer's recomputation of every sampled token's log-prob (its own collate and forward)."""
    trajs = [Trajectory(prompt, gen.output_ids, gen.logprobs, gen.versions) for prompt, gen in samples]
    batch = collate(trajs, [0.0] * len(trajs), pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature)
    return [logp[i, len(t.prompt_ids) - 1 : len(t.prompt_ids) - 1 + len(t.output_ids)] for i, t in enumerate(trajs)]


def largest_gap(twins: Twins, engine: Any, temperature: float) -> float:
    samples = twins.generate(engine, SamplingParams(max_new_tokens=24, temperature=temperature), copies=4)
    expected = trainer_logprobs(twins.model, samples, temperature)
    return max(float((torch.tensor(gen.logprobs) - want).abs().max()) for (_, gen), want in
               zip(samples, expected, strict=True))  # fmt: skip


def assert_serves_the_trainers_policy(twins: Twins) -> None:
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    from_vllm = [g.output_ids for _, g in twins.generate(twins.vllm, greedy, copies=1)]
    from_torch = [g.output_ids for _, g in twins.generate(twins.torch, greedy, copies=1)]
    assert from_vllm == from_torch
    for temperature in (1.0, 0.7):
        assert largest_gap(twins, twins.vllm, temperature) < TOLERANCE, f"vLLM at T={temperature}"
        assert largest_gap(twins, twins.torch, temperature) < TOLERANCE, f"torch engine at T={temperature}"


def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # tied embeddings stay tied, as the trainer's are
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))


def as_broadcast(model: torch.nn.Module, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What /update_weights parses from the request body (BroadcastSync)."""
    return load_safetensors(to_safetensors(model.state_dict()))


def as_disk(model: torch.nn.Module, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What /update_weights?path= reads from the file DiskSync wrote."""
    return load_file(DiskSync(None, tmp_path).payload(model.state_dict(), version=1))


def as_p2p(model: torch.nn.Module, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The p2p receiver's staging dict once every piece arrived: one tensor per parameter name."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


UPDATES: dict[str, Callable[[torch.nn.Module, Path], dict[str, torch.Tensor]]] = {
    "broadcast": as_broadcast, "disk": as_disk, "p2p": as_p2p,
}


def test_first_load_serves_the_trainers_policy(twins: Twins):
    assert_serves_the_trainers_policy(twins)


@pytest.mark.parametrize("mode", list(UPDATES))
def test_every_update_serves_the_trainers_policy(twins: Twins, mode: str, tmp_path: Path):
    perturb(twins.model, seed=len(mode) + twins.vllm.version)
    state = UPDATES[mode](twins.model, tmp_path)
    version = twins.vllm.version + 1
    twins.run(twins.vllm.load_weights(dict(state), version))
    if mode == "p2p":
        twins.run(twins.torch.receive_parameters(dict(state), version))
    else:
        twins.run(twins.torch.load_weights(dict(state), version))
    assert twins.vllm.version == twins.torch.version == version
    assert_serves_the_trainers_policy(twins)


def test_an_incomplete_update_is_refused_before_anything_is_paused(twins: Twins):
    state = as_p2p(twins.model, Path())
    dropped = sorted(state)[-1]
    del state[dropped]
    version = twins.vllm.version
    with pytest.raises(ValueError, match="missing"):
        twins.run(twins.vllm.load_weights(state, version + 1))
    assert twins.vllm.version == version and twins.vllm.health() is None and not twins.vllm.paused
