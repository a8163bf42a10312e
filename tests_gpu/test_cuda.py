"""The CUDA path on one GPU: the FSDP2 actor over NCCL in bfloat16, the torch engine's KV cache on
the device and its gap to the trainer, a weight update that the engine then serves exactly,
Megatron-core on CUDA without the CPU shim against the FSDP actor, and a LoRA adapter trained and
served. Skipped without CUDA (conftest)."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from kuberl.devices import placed
from kuberl.fsdp.actor import FSDPActor
from kuberl.inference.contract import SamplingParams
from kuberl.inference.engine import TorchEngine, generate_all
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.policy.actor import token_logprobs_and_entropy
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, collate
from kuberl.rollout.types import Trajectory

from .conftest import report

CONFIG = AlgorithmConfig(name="grpo", group_size=4, kl_coef=0.0)
PROMPTS = [[2, 10 + a, 15, 10 + b, 11] for a in range(4) for b in range(4)]  # 16 prompts of the char vocabulary
GAP_MEAN_BOUND = 0.05  # |engine − trainer| log-prob per token, bfloat16 both: what a healthy pair stays under
GAP_MAX_BOUND = 1.0


def policy() -> torch.nn.Module:
    return tiny_qwen2(len(char_tokenizer()), seed=3)


def engine_on(device: torch.device, state: dict[str, torch.Tensor], dtype: torch.dtype) -> TorchEngine:
    """A torch engine on ``device`` in ``dtype`` holding ``state`` (as a replica after a weight update)."""
    model = policy()
    model.load_state_dict(state)
    tok = char_tokenizer()
    return TorchEngine(placed(model, device, dtype), tok.eos_token_id, tok.pad_token_id, seed=0)  # as a replica


def batch_of(generations: list, prompts: list[list[int]]) -> Batch:
    trajs = [Trajectory(p, g.output_ids, g.logprobs, g.versions) for p, g in zip(prompts, generations, strict=True)]
    return collate(trajs, [1.0 if i % 2 else -1.0 for i in range(len(trajs))], pad_id=0, version=0)


def test_the_fsdp_actor_trains_in_bfloat16_on_cuda_over_nccl(nccl_world_of_one):
    device = nccl_world_of_one
    actor = FSDPActor.create(policy(), CONFIG, lr=1e-2, temperature=1.0, device=device, compute_dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in actor.full_state_dict().items()}
    assert all(p.device.type == "cuda" for p in actor.model.parameters())
    state = actor.full_state_dict()
    gens = generate_all(engine_on(device, state, torch.bfloat16), PROMPTS * 4, SamplingParams(max_new_tokens=24))
    batch = batch_of(gens, PROMPTS * 4)
    torch.cuda.synchronize()
    started = time.perf_counter()
    stats = actor.train_step(batch, batch.size)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values() if isinstance(v, float)), stats
    assert stats["ppo_actor/grad_norm"] > 0
    after = actor.full_state_dict()
    assert any(not torch.equal(after[k].cpu(), before[k].cpu()) for k in before)
    report(fsdp_bf16_step_seconds=round(seconds, 4), fsdp_bf16_step_stats={k: round(v, 5) for k, v in stats.items()
                                                                           if isinstance(v, float)})


def test_the_torch_engine_generates_on_cuda_within_a_bounded_gap_of_the_trainer(nccl_world_of_one):
    """The engine's KV-cache decode on the GPU in bfloat16, scored by the FSDP actor in bfloat16 on the
    same weights: the behaviour log-prob gap (what decoupled PPO corrects) is reported and bounded."""
    device = nccl_world_of_one
    actor = FSDPActor.create(policy(), CONFIG, lr=1e-2, temperature=1.0, device=device, compute_dtype=torch.bfloat16)
    engine = engine_on(device, actor.full_state_dict(), torch.bfloat16)
    started = time.perf_counter()
    gens = generate_all(engine, PROMPTS * 4, SamplingParams(max_new_tokens=32))
    seconds = time.perf_counter() - started
    tokens = sum(len(g.output_ids) for g in gens)
    assert tokens > len(gens) and all(len(g.logprobs) == len(g.output_ids) for g in gens)
    batch = batch_of(gens, PROMPTS * 4).to(device)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(actor.model, batch, 1.0)
    trained = batch.loss_mask.bool()
    gap = (logp[trained].float() - batch.behav_logp[trained].float()).abs()
    report(engine_bf16_tokens=tokens, engine_bf16_tokens_per_second=round(tokens / seconds, 1),
           engine_trainer_gap_mean=round(float(gap.mean()), 5), engine_trainer_gap_max=round(float(gap.max()), 5))
    assert float(gap.mean()) < GAP_MEAN_BOUND and float(gap.max()) < GAP_MAX_BOUND


def test_after_a_weight_update_the_engine_answers_greedily_as_the_trainer(nccl_world_of_one):
    """After a training step the engine takes the trainer's weights (float32 both, TF32 off: exact
    argmaxes) and its greedy answers on 16 prompts are the trained policy's through Hugging Face's
    generate on the same device."""
    device = nccl_world_of_one
    torch.backends.cuda.matmul.allow_tf32 = False
    actor = FSDPActor.create(policy(), CONFIG, lr=1e-2, temperature=1.0, device=device)
    engine = engine_on(device, actor.full_state_dict(), torch.float32)
    trained: dict[str, torch.Tensor] = {}

    async def train_update_then_answer() -> list:  # one event loop: the engine's own
        engine.start()
        try:
            gens = list(await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16))
                                                for p in PROMPTS * 2)))
            actor.train_step(batch_of(gens, PROMPTS * 2), 2 * len(PROMPTS))
            trained.update({k: v.detach().clone() for k, v in actor.full_state_dict().items()})
            started = time.perf_counter()
            await engine.load_weights(trained, version=1)
            report(engine_weight_update_seconds=round(time.perf_counter() - started, 4))
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
            return list(await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS)))
        finally:
            await engine.stop()

    answers = asyncio.run(train_update_then_answer())
    reference = policy()
    reference.load_state_dict({k: v.cpu() for k, v in trained.items()})
    reference = reference.to(device).eval()
    tok = char_tokenizer()
    for prompt, gen in zip(PROMPTS, answers, strict=True):
        assert set(gen.versions) == {1}
        with torch.no_grad():
            ours = reference.generate(torch.tensor([prompt], device=device), max_new_tokens=8, do_sample=False,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        expected = ours[0, len(prompt):].tolist()
        assert gen.output_ids == expected[:len(gen.output_ids)], (prompt, gen.output_ids, expected)


def test_megatron_on_cuda_without_the_shim_reads_and_trains_as_the_fsdp_actor(nccl_world_of_one):
    """Megatron-core's GPTModel on cuda:0 (tensor, pipeline and expert parallel 1; no CPU shim: it is
    only entered for a CPU device) against the FSDP actor on the same HF weights, both in bfloat16:
    per-token log-probs and the first step's gradient norm agree within bfloat16's tolerance."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/gpu-wheels carries it)")
    from megatron.core import parallel_state

    from kuberl.megatron.actor import MegatronActor
    from kuberl.megatron.cpu import on_device

    device = nccl_world_of_one
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    hf = policy()
    hf.model.embed_tokens.padding_idx = None  # HF never trains the pad id's row, Megatron does (0: a token it samples)
    fsdp = FSDPActor.create(copy.deepcopy(hf), CONFIG, lr=1e-2, temperature=1.0, device=device,
                        compute_dtype=torch.bfloat16)
    megatron = MegatronActor.from_hf(copy.deepcopy(hf), CONFIG, lr=1e-2, temperature=1.0, device=device,
                                     compute_dtype=torch.bfloat16)
    assert all(p.device.type == "cuda" for p in megatron.model.parameters())
    with on_device(device):  # what the Megatron actor enters around its steps: the shim would answer "cpu"
        assert torch.cuda.current_device() == 0
    gens = generate_all(engine_on(device, fsdp.full_state_dict(), torch.bfloat16), PROMPTS * 2,
                        SamplingParams(max_new_tokens=16))
    batch = batch_of(gens, PROMPTS * 2)
    there = batch.to(device)
    with torch.no_grad():
        ours, _ = fsdp.scorer(fsdp.model, there, 1.0)
        theirs, _ = megatron.scorer(megatron.model, there, 1.0)
    trained = there.loss_mask.bool()
    gap = (ours[trained].float() - theirs[trained].float()).abs()
    norms = [actor.train_step(batch, batch.size)["ppo_actor/grad_norm"] for actor in (fsdp, megatron)]
    report(megatron_fsdp_logp_gap_max=round(float(gap.max()), 5), megatron_fsdp_grad_norms=norms)
    assert float(gap.max()) < 0.1
    assert norms[1] == pytest.approx(norms[0], rel=5e-2)


def test_a_lora_adapter_trains_on_cuda_and_the_engine_serves_it_within_the_gap(nccl_world_of_one):
    """spec.trainer.lora on the GPU: the FSDP actor trains only the adapter in bfloat16 over NCCL; the
    engine (base plus an untrained adapter, bfloat16) takes the adapter alone as its update and then
    samples within the same bounded gap of the trainer's log-probs; the update's share of the model's
    bytes is reported."""
    from kuberl.api.lora import LoraSpec
    from kuberl.models import lora
    from kuberl.weights.sync import update_bytes

    device, spec = nccl_world_of_one, LoraSpec(rank=8)
    actor = FSDPActor.create(policy(), CONFIG, lr=1e-2, temperature=1.0, device=device,
                             compute_dtype=torch.bfloat16, adapter=spec)
    tok = char_tokenizer()
    engine = TorchEngine(lora.add_adapter(policy(), spec).to(device=device, dtype=torch.bfloat16), tok.eos_token_id,
                         tok.pad_token_id, seed=0)

    async def train_update_then_sample() -> list:  # one event loop: the engine's own
        engine.start()
        try:
            gens = list(await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16))
                                                for p in PROMPTS * 2)))
            torch.cuda.synchronize()
            started = time.perf_counter()
            stats = actor.train_step(batch_of(gens, PROMPTS * 2), 2 * len(PROMPTS))
            torch.cuda.synchronize()
            report(lora_step_seconds=round(time.perf_counter() - started, 4),
                   lora_grad_norm=stats["ppo_actor/grad_norm"])
            update = actor.weight_source().full_state_dict()
            assert update and all(lora.is_adapter_weight(n) for n in update)
            await engine.load_weights(update, version=1)
            return list(await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=24))
                                                for p in PROMPTS * 4)))
        finally:
            await engine.stop()

    gens = asyncio.run(train_update_then_sample())
    batch = batch_of(gens, PROMPTS * 4).to(device)
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(actor.model, batch, 1.0)
    trained = batch.loss_mask.bool()
    gap = (logp[trained].float() - batch.behav_logp[trained].float()).abs()
    report(lora_update_fraction=round(update_bytes(actor.weight_source()) / update_bytes(actor), 5),
           lora_engine_trainer_gap_mean=round(float(gap.mean()), 5),
           lora_engine_trainer_gap_max=round(float(gap.max()), 5))
    assert all(set(g.versions) == {1} for g in gens)
    assert float(gap.mean()) < GAP_MEAN_BOUND and float(gap.max()) < GAP_MAX_BOUND
