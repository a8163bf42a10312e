"""What the vLLM adapter hands its workers for a weight update (pure; the engine itself is tested
in tests_vllm/): every parameter exactly once, whichever name a tied one arrives under, and an
update that lacks a parameter is refused rather than half-served."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors

from kuberl.inference.vllm_engine import checkpoint_state, hf_parameter_layout, tied_aliases
from kuberl.models.tiny import tiny_qwen2
from kuberl.weights.sync import to_safetensors


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_qwen2(24, seed=0, tied=request.param)


def test_aliases_name_exactly_the_tied_output_layer(model):
    tied = model.config.tie_word_embeddings
    assert tied_aliases(model) == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert ("lm_head.weight" in hf_parameter_layout(model)) != tied


@pytest.mark.parametrize("form", ["full state dict", "safetensors round trip", "parameters only"])
def test_every_sync_form_becomes_every_parameter_once(model, form):
    if form == "full state dict":
        state = model.state_dict()  # a tied tensor under both names, one storage
    elif form == "safetensors round trip":
        state = load_safetensors(to_safetensors(model.state_dict()))  # both names, two storages
    else:
        state = dict(model.named_parameters())  # p2p staging: tied tensors once
    layout = hf_parameter_layout(model)
    out = checkpoint_state(state, layout, tied_aliases(model))
    assert out.keys() == layout.keys()
    for name, tensor in out.items():
        assert torch.equal(tensor, dict(model.named_parameters())[name]) and tensor.is_contiguous()


def test_a_partial_or_foreign_update_is_refused_naming_the_tensor(model):
    layout, aliases = hf_parameter_layout(model), tied_aliases(model)
    state = dict(model.named_parameters())
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        checkpoint_state(state, layout, aliases)
    with pytest.raises(ValueError, match=r"unexpected tensor 'extra\.weight'"):
        checkpoint_state({**dict(model.named_parameters()), "extra.weight": torch.zeros(1)}, layout, aliases)
    wrong = {**dict(model.named_parameters()), "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape"):
        checkpoint_state(wrong, layout, aliases)
