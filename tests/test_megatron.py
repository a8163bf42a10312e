"""The Megatron-core backend's verifiable parts: HF ↔ Megatron conversion (pure), and a real
megatron-core GPTModel built on CPU, loaded from HF weights and exported back bit for bit.
Its forward pass needs CUDA (megatron-core's rotary embedding); that test runs where CUDA is."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from kuberl.megatron.convert import AttentionShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from kuberl.models.tiny import char_tokenizer, tiny_qwen2


def qwen2() -> torch.nn.Module:
    return tiny_qwen2(len(char_tokenizer()), seed=3)


def llama_untied_gqa() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=40, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False,
                         max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(5)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("make", [qwen2, llama_untied_gqa], ids=["qwen2-tied-bias", "llama-untied-gqa"])
def test_round_trip_is_exact(make):
    model = make()
    state = model.state_dict()
    megatron = hf_to_megatron(state, model.config)
    assert all(name.startswith(("embedding.", "decoder.", "output_layer.")) for name in megatron)
    assert ("output_layer.weight" in megatron) == (not model.config.tie_word_embeddings)
    back = megatron_to_hf(megatron, model.config)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # same number of values, nothing duplicated or lost (tied embedding counted once)
    unique = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in megatron.values()) == unique


def test_qkv_is_interleaved_by_query_group():
    shape = AttentionShape(heads=6, groups=2, head_dim=4)
    hidden = 5
    # row r of q belongs to head r // head_dim; label every row with (tensor, head)
    q = torch.arange(6).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 100
    k = torch.arange(2).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 200
    v = torch.arange(2).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 300
    fused = fuse_qkv(q, k, v, shape)
    heads_in_order = fused[::4, 0].tolist()  # one row per head
    assert heads_in_order == [100, 101, 102, 200, 300, 103, 104, 105, 201, 301]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v), strict=True))


def test_bad_configs_are_refused():
    model = llama_untied_gqa()
    state = model.state_dict()
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"q/k/v_proj\.weight must be all present"):
        hf_to_megatron(state, model.config)
    model.config.num_key_value_heads = 4
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        AttentionShape.of(model.config)


@pytest.fixture
def megatron_parallel_state(tmp_path) -> Iterator[None]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    from megatron.core import parallel_state

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatron_model_loads_hf_weights_and_exports_them_unchanged(megatron_parallel_state):
    from kuberl.megatron.model import build_gpt_model, export_hf_state, load_hf_state

    hf = qwen2()
    meg = build_gpt_model(hf.config)
    assert sum(p.numel() for p in meg.parameters()) == sum(p.numel() for p in hf.parameters())
    load_hf_state(meg, hf.state_dict(), hf.config)
    exported = export_hf_state(meg, hf.config)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    wrong = {**hf.state_dict(), "model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match=r"decoder\.final_layernorm\.weight"):
        load_hf_state(meg, wrong, hf.config)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="megatron-core 0.16's forward needs CUDA (rotary embedding on torch.cuda.current_device())")
def test_megatron_forward_matches_hf(megatron_parallel_state):  # pragma: no cover - runs on GPU machines
    from kuberl.megatron.model import build_gpt_model, load_hf_state

    hf = qwen2().cuda().eval()
    meg = build_gpt_model(hf.config)
    load_hf_state(meg, hf.state_dict(), hf.config)
    meg = meg.cuda().eval()
    ids = torch.randint(4, hf.config.vocab_size, (2, 12), device="cuda")
    positions = torch.arange(12, device="cuda").expand(2, -1)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = meg(ids, positions, None)
    assert torch.allclose(got.float(), expected.float(), atol=1e-3)
