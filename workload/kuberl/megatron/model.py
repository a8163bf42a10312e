"""Build a Megatron-core ``GPTModel`` for an HF config and load HF weights into it.

Needs ``megatron-core`` (imported here, not at package import) and an initialised
``megatron.core.parallel_state``. Uses Megatron's local (non-Transformer-Engine) layer spec, whose
parameter names :mod:`.convert` maps. Megatron-core 0.16's forward pass needs CUDA (its rotary
embedding moves ``inv_freq`` to ``torch.cuda.current_device()``): on CPU the model can be built,
loaded and exported, not run.
"""

from __future__ import annotations

from typing import Any

import torch

from .convert import hf_to_megatron, megatron_to_hf, transformer_config_kwargs


def build_gpt_model(hf_config: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(hf_config))
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )  # fmt: skip


def load_hf_state(model: Any, state: dict[str, torch.Tensor], hf_config: Any) -> None:
    """Copy a full HF state dict into ``model`` (tensor parallel 1); every parameter must be set."""
    converted = hf_to_megatron(state, hf_config)
    params = dict(model.named_parameters())
    missing, unexpected = sorted(params.keys() - converted.keys()), sorted(converted.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"HF weights do not fit the Megatron model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in converted.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: model has {tuple(params[name].shape)}, weights {tuple(tensor.shape)}")
            params[name].copy_(tensor)


def export_hf_state(model: Any, hf_config: Any) -> dict[str, torch.Tensor]:
    """The model's parameters under HF names: what the weight sync sends to vLLM / torch replicas."""
    return megatron_to_hf({n: p.detach() for n, p in model.named_parameters()}, hf_config)
