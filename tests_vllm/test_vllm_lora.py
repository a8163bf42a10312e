"""The vllm engine with a LoRA adapter (spec.trainer.lora) on the real vLLM engine: it serves the base
until the first update, then each update's adapter, and its behaviour log-probs are those of the
Hugging Face model carrying the same adapter (peft), run here in float32."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kuberl.api.lora import LoraSpec
from kuberl.inference.contract import SamplingParams
from kuberl.inference.vllm_engine import AdapterServing, VLLMEngine, build_vllm_engine, hf_parameter_layout
from kuberl.models import lora
from kuberl.models.hf_dir import write_hf_dir
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from test_vllm_engine import reference_logprobs  # tests_vllm is not a package: pytest puts it on the path

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv (scripts/setup --vllm)")
peft = pytest.importorskip("peft", reason="peft is not installed in this venv (scripts/setup --vllm)")

SPEC = LoraSpec(rank=4, target_modules=["all-linear"])
PROMPTS = [[2, 10, 15, 4, 11, 22], [2, 13, 15, 17, 11]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMEngine, torch.nn.Module, Any]]:
    """One engine serving adapters on the tiny base, the base with an adapter (HF + peft), a runner."""
    model_dir = tmp_path_factory.mktemp("base")
    tokenizer = char_tokenizer()
    base = tiny_qwen2(len(tokenizer), seed=0).eval()
    write_hf_dir(base.state_dict(), base.config, tokenizer, model_dir, torch.float32)
    adapted = lora.add_adapter(tiny_qwen2(len(tokenizer), seed=0).eval(), SPEC)
    layout = lora.adapter_only(hf_parameter_layout(adapted))
    loop = asyncio.new_event_loop()

    async def build() -> VLLMEngine:
        return build_vllm_engine(str(model_dir), tokenizer.eos_token_id, hf_parameter_layout(base), {}, seed=0,
                                 dtype="float32", eager=True, max_model_len=256, cpu_kv_cache_gib=1,
                                 adapter=AdapterServing(SPEC, "builtin:tiny-qwen2", layout))  # fmt: skip

    engine = loop.run_until_complete(build())
    try:
        yield engine, adapted, loop.run_until_complete
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()


def new_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Draw A and B (B ≠ 0: the adapter changes the policy) into ``model``; its adapter's tensors."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter_weight(name):
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    return {k: v.clone() for k, v in lora.adapter_only(model.state_dict()).items()}


def sample(engine: VLLMEngine, run: Any) -> list[Any]:
    async def all_of() -> list[Any]:
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        return list(await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS)))

    return run(all_of())


def gap(model: torch.nn.Module, gens: list[Any]) -> float:
    return max(float((reference_logprobs(model, p, g, 1.0) - torch.tensor(g.logprobs)).abs().max())
               for p, g in zip(PROMPTS, gens, strict=True))


def test_the_base_then_each_updates_adapter_is_served(served):
    engine, adapted, run = served
    base = tiny_qwen2(adapted.config.vocab_size, seed=0).eval()
    assert gap(base, sample(engine, run)) < 1e-4  # version 0: the base (an adapter with B = 0)
    for version, seed in ((1, 1), (2, 2)):
        run(engine.load_weights(new_adapter(adapted, seed), version))
        gens = sample(engine, run)
        assert all(g.versions == [version] * len(g.output_ids) for g in gens)
        assert gap(adapted, gens) < 1e-4, version  # the adapter of this update, not the last one's
        assert gap(base, gens) > 1e-2


def test_an_update_that_is_not_the_adapter_is_refused_and_the_adapter_stays(served):
    engine, adapted, run = served
    update = new_adapter(adapted, 3)
    run(engine.load_weights(update, 3))
    with pytest.raises(ValueError, match="missing"):
        run(engine.load_weights(dict(list(update.items())[1:]), 4))
    assert engine.version == 3 and engine.health() is None
    assert gap(adapted, sample(engine, run)) < 1e-4
