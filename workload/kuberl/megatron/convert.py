"""Hugging Face Qwen2 / Llama checkpoints ↔ Megatron-core ``GPTModel`` (local layer spec). Pure torch.

Names (layer ``i``; HF left, Megatron right)::

    model.embed_tokens.weight                     embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.*       decoder.layers.i.self_attention.linear_qkv.*   (fused)
    model.layers.i.self_attn.o_proj.weight        decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight      decoder.layers.i.mlp.linear_fc1.weight         (fused)
    model.layers.i.mlp.down_proj.weight           decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                             decoder.final_layernorm.weight
    lm_head.weight                                output_layer.weight   (absent when embeddings are tied)

Fused layouts, along dim 0:
- ``linear_qkv`` is grouped by key/value head: for each of the G query groups, its H/G query heads,
  then its key head, then its value head (each ``head_dim`` rows). HF keeps q (H heads), k (G),
  v (G) in three tensors. This interleaving is what lets Megatron split ``linear_qkv`` across
  tensor-parallel ranks by whole groups.
- ``linear_fc1`` = [gate; up]: Megatron's gated unit computes ``silu(x₀) · x₁`` on the two halves,
  HF's MLP ``silu(gate(x)) · up(x)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

_RENAMES = {  # per layer, HF suffix → Megatron suffix, for the tensors that map one to one
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}  # fmt: skip


@dataclass(frozen=True)
class AttentionShape:
    heads: int  # query heads H
    groups: int  # key/value heads G (H for plain multi-head attention)
    head_dim: int

    @classmethod
    def of(cls, hf_config: Any) -> AttentionShape:
        heads = hf_config.num_attention_heads
        groups = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        if heads % groups:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
        return cls(heads, groups, head_dim)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """HF q/k/v (weights or biases) → Megatron's group-interleaved ``linear_qkv``."""
    per_group = shape.heads // shape.groups
    rest = q.shape[1:]
    q = q.reshape(shape.groups, per_group * shape.head_dim, *rest)
    k = k.reshape(shape.groups, shape.head_dim, *rest)
    v = v.reshape(shape.groups, shape.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    per_group = shape.heads // shape.groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(shape.groups, (per_group + 2) * shape.head_dim, *rest)
    q, k, v = grouped.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """A full HF state dict → the Megatron-core GPTModel state dict (tied ``lm_head`` dropped)."""
    shape = AttentionShape.of(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for hf_name, meg_name in _GLOBAL.items():
        if hf_name in state and not (tied and hf_name == "lm_head.weight"):
            out[meg_name] = state[hf_name]
    for i in range(hf_config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, meg_suffix in _RENAMES.items():
            out[dst + meg_suffix] = state[src + hf_suffix]
        for kind in ("weight", "bias"):
            parts = [state.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if all(t is not None for t in parts):
                out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(*parts, shape)  # type: ignore[arg-type]
            elif any(t is not None for t in parts):
                raise ValueError(f"layer {i}: q/k/v_proj.{kind} must be all present or all absent")
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([state[f"{src}mlp.gate_proj.weight"],
                                                        state[f"{src}mlp.up_proj.weight"]])  # fmt: skip
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def megatron_to_hf(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (``_extra_state`` entries ignored); a tied model gets
    ``lm_head.weight`` as the embedding again, as HF's state dict has it."""
    shape = AttentionShape.of(hf_config)
    back_global = {v: k for k, v in _GLOBAL.items()}
    back_layer = {v: k for k, v in _RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("._extra_state"):
            continue
        if name in back_global:
            out[back_global[name]] = tensor
            continue
        match = _LAYER.fullmatch(name)
        if match is None:
            raise ValueError(f"unexpected Megatron parameter {name!r}")
        prefix, suffix = f"model.layers.{match[1]}.", match[2]
        if suffix in back_layer:
            out[prefix + back_layer[suffix]] = tensor
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for part, piece in zip("qkv", split_qkv(tensor, shape), strict=True):
                out[f"{prefix}self_attn.{part}_proj.{kind}"] = piece
        elif suffix == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
        else:
            raise ValueError(f"unexpected Megatron parameter {name!r}")
    if getattr(hf_config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` arguments for a Qwen2 / Llama HF config (float32, CPU init)."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: only silu (gated) MLPs are converted")
    shape = AttentionShape.of(hf_config)
    return {
        "num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
        "num_attention_heads": shape.heads, "num_query_groups": shape.groups, "kv_channels": shape.head_dim,
        "ffn_hidden_size": hf_config.intermediate_size, "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu, "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps, "add_bias_linear": False,
        "add_qkv_bias": hf_config.model_type == "qwen2", "use_cpu_initialization": True,
        "params_dtype": torch.float32, "bf16": False,
        # the HF models have no dropout after attention or MLP; Megatron's default of 0.1 would
        # train a different (noisier) policy than the engines sample from
        "hidden_dropout": 0.0, "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
    }  # fmt: skip
