"""Routing replay (R3) where the engine's kernels are not the trainer's: on CUDA.

On the CPU the torch engine and both trainer backends compute a Qwen3-MoE's bfloat16 log-probs alike
(one-token answers: bit for bit; long ones differ only by the decode step's attention rounding,
``benchmarks/routing_replay_decode.py``), so replay has little to remove there. On a GPU cuBLAS picks
its GEMM by shape — Megatron's fused q/k/v and [gate; up] against the HF model's separate projections —
and the engine decodes with one query over its KV cache: router scores move, and tokens whose k-th and
(k+1)-th experts were close go elsewhere in the trainer. Here the engine samples on cuda:0 and returns
its routes; the FSDP path and Megatron-core (no CPU shim) read the samples' log-probs without and with
them. Reported: each backend's mean and largest |log π_trainer − log π_engine| off and on, and off ÷ on
(issue 47's measure); asserted: replay never widens the gap and keeps it within the healthy bound.
Skipped without CUDA (conftest)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kuberl.devices import placed
from kuberl.fsdp.actor import FSDPActor
from kuberl.inference.contract import SamplingParams
from kuberl.inference.engine import TorchEngine, generate_all
from kuberl.models.tiny import char_tokenizer, tiny_qwen3_moe
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, collate
from kuberl.rollout.types import Trajectory

from .conftest import report

CONFIG = AlgorithmConfig(name="grpo", group_size=4, kl_coef=0.0)
GAP_MEAN_BOUND = 0.05  # as tests_gpu/test_cuda.py: what a healthy engine–trainer pair stays under
EXPERTS, TOP_K, LAYERS, HIDDEN = 32, 4, 4, 256


def moe_policy() -> torch.nn.Module:
    return tiny_qwen3_moe(len(char_tokenizer()), seed=0, hidden=HIDDEN, layers=LAYERS, experts=EXPERTS, top_k=TOP_K)


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[2, *torch.randint(3, vocab, (int(n),), generator=generator).tolist()]
            for n in torch.randint(3, 12, (count,), generator=generator)]


def sampled_with_routes(model: torch.nn.Module, device: torch.device, prompts: list[list[int]]) -> Batch:
    """The engine (``model`` on ``device`` in bfloat16, as a replica holds it) samples 64 tokens per prompt
    and returns its routes; the trajectories as the trainer batches them."""
    tok = char_tokenizer()
    engine = TorchEngine(placed(model, device, torch.bfloat16), tok.eos_token_id, tok.pad_token_id, seed=0)
    gens = generate_all(engine, prompts, SamplingParams(max_new_tokens=64, return_routes=True))
    assert all(g.routes is not None for g in gens)
    trajs = [Trajectory(p, g.output_ids, g.logprobs, g.versions, routes=g.routes) for p, g in zip(prompts, gens,
                                                                                                  strict=True)]
    return collate(trajs, [0.0] * len(trajs), pad_id=tok.pad_token_id, version=0)


def gaps(scorer, model: torch.nn.Module, batch: Batch) -> dict[str, float]:
    """Mean and largest |log π_trainer − log π_engine| per generated token, without and with the routes."""
    trained = batch.loss_mask.bool()
    out = {}
    for mode, routed in (("off", dataclasses.replace(batch, routes=batch.routes[:, :, :0])), ("on", batch)):
        with torch.no_grad():
            logp, _ = scorer(model, routed, 1.0)
        gap = (logp[trained].float() - batch.behav_logp[trained].float()).abs()
        out |= {f"{mode}_mean": round(float(gap.mean()), 6), f"{mode}_max": round(float(gap.max()), 5)}
    return out | {"mean_off_over_on": round(out["off_mean"] / max(out["on_mean"], 1e-9), 2)}


def test_routing_replay_on_cuda_removes_what_rerouting_adds_to_the_engine_trainer_gap(nccl_world_of_one):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/gpu-wheels carries it)")
    from megatron.core import parallel_state

    from kuberl.megatron.actor import MegatronActor
    from kuberl.megatron.cpu import on_device

    device = nccl_world_of_one
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    hf = moe_policy()
    batch = sampled_with_routes(copy.deepcopy(hf), device, random_prompts(64, hf.config.vocab_size)).to(device)
    fsdp = FSDPActor.create(copy.deepcopy(hf), CONFIG, lr=1e-2, temperature=1.0, device=device,
                            compute_dtype=torch.bfloat16)
    megatron = MegatronActor.from_hf(copy.deepcopy(hf), CONFIG, lr=1e-2, temperature=1.0, device=device,
                                     compute_dtype=torch.bfloat16)
    measured = {"fsdp": gaps(fsdp.scorer, fsdp.model, batch)}
    with on_device(device):
        measured["megatron"] = gaps(megatron.scorer, megatron.model, batch)
    report(route_replay_cuda={"model": {"experts": EXPERTS, "top_k": TOP_K, "layers": LAYERS, "hidden": HIDDEN},
                              "tokens": int(batch.loss_mask.sum()), **measured})
    for backend, gap in measured.items():
        assert gap["on_mean"] <= gap["off_mean"] * 1.05 + 1e-5, (backend, gap)
        assert gap["on_mean"] < GAP_MEAN_BOUND, (backend, gap)
