"""Hugging Face Qwen2 / Qwen3 / Llama checkpoints ↔ Megatron-core ``GPTModel`` (local layer spec). Pure torch.

Names (layer ``i``; HF left, Megatron right)::

    model.embed_tokens.weight                     embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.*       decoder.layers.i.self_attention.linear_qkv.*   (fused)
    model.layers.i.self_attn.o_proj.weight        decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.self_attn.{q,k}_norm.weight    decoder.layers.i.self_attention.{q,k}_layernorm.weight (Qwen3)
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

Qwen3's per-head RMSNorm of queries and keys (``head_dim`` weights each, applied before the rotary
embedding) is Megatron's ``qk_layernorm``; Qwen3 has no q/k/v bias, Qwen2 has one.

Qwen3-MoE (every layer a mixture of experts, no shared expert)::

    model.layers.i.mlp.gate.weight                decoder.layers.i.mlp.router.weight
    model.layers.i.mlp.experts.gate_up_proj[j]    decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight
    model.layers.i.mlp.experts.down_proj[j]       decoder.layers.i.mlp.experts.local_experts.j.linear_fc2.weight

(transformers keeps each layer's experts stacked; ``[gate; up]`` rows as in ``linear_fc1``.)
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

_RENAMES = {  # per layer, HF suffix → Megatron suffix, for the tensors that map one to one
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_DENSE = {"mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_ROUTER = {"mlp.gate.weight": "mlp.router.weight"}
_QK_NORM = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
            "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}  # fmt: skip


def tied(hf_config: Any) -> bool:
    """Whether the output layer is the word embedding (``tie_word_embeddings``)."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def has_qk_norm(hf_config: Any) -> bool:
    """Qwen3 normalises each query and key head (``q_norm`` / ``k_norm``)."""
    return str(getattr(hf_config, "model_type", "")).startswith("qwen3")


def experts(hf_config: Any) -> int:
    """Routed experts per layer (Qwen3-MoE: every layer sparse), 0 for a dense model."""
    count = int(getattr(hf_config, "num_experts", 0) or 0)
    if count and (getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1):
        raise ValueError("mlp_only_layers / decoder_sparse_step: only models whose every layer is a mixture of "
                         "experts are converted")
    if count and getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError("shared_expert_intermediate_size: shared experts are not converted")
    return count


def _renames(hf_config: Any) -> dict[str, str]:
    """Per layer, HF suffix → Megatron suffix, for the tensors that map one to one in this model."""
    return {**_RENAMES, **(_ROUTER if experts(hf_config) else _DENSE), **(_QK_NORM if has_qk_norm(hf_config) else {})}


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


def hf_to_megatron(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """A full HF state dict → the Megatron-core GPTModel state dict (tied ``lm_head`` dropped)."""
    out = global_tensors(state, hf_config)
    for i in range(hf_config.num_hidden_layers):
        out |= layer_tensors(state, hf_config, i)
    return out


def global_tensors(state: Mapping[str, torch.Tensor], hf_config: Any,
                   only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The embedding, the final norm and an untied output layer of an HF state, under Megatron names
    — those of them named in ``only``, when given (``state`` may read its tensors on demand: only
    these are taken)."""
    return {meg_name: state[hf_name] for hf_name, meg_name in _GLOBAL.items()
            if hf_name in state and not (tied(hf_config) and hf_name == "lm_head.weight")
            and (only is None or meg_name in only)}  # fmt: skip


def layer_tensors(state: Mapping[str, torch.Tensor], hf_config: Any, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s tensors of an HF state under Megatron names (fused q/k/v and gate/up, experts one
    by one); only layer ``i``'s are taken from ``state``."""
    shape, moe = AttentionShape.of(hf_config), bool(experts(hf_config))
    src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {dst + meg_suffix: state[src + hf_suffix] for hf_suffix, meg_suffix in _renames(hf_config).items()}
    for kind in ("weight", "bias"):
        parts = [state.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv"]
        if all(t is not None for t in parts):
            out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(*parts, shape)  # type: ignore[arg-type]
        elif any(t is not None for t in parts):
            raise ValueError(f"layer {i}: q/k/v_proj.{kind} must be all present or all absent")
    if moe:  # HF stacks them: gate_up_proj [E, 2I, H] ([gate; up] rows), down_proj [E, H, I]
        for j, (fc1, fc2) in enumerate(zip(state[f"{src}mlp.experts.gate_up_proj"],
                                           state[f"{src}mlp.experts.down_proj"], strict=True)):  # fmt: skip
            out[f"{dst}mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1
            out[f"{dst}mlp.experts.local_experts.{j}.linear_fc2.weight"] = fc2
    else:
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([state[f"{src}mlp.gate_proj.weight"],
                                                        state[f"{src}mlp.up_proj.weight"]])  # fmt: skip
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def megatron_to_hf(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (``_extra_state`` entries ignored); a tied model gets
    ``lm_head.weight`` as the embedding again, as HF's state dict has it (when ``state`` holds the
    embedding: a later pipeline stage's does not)."""
    shape = AttentionShape.of(hf_config)
    back_global = {v: k for k, v in _GLOBAL.items()}
    back_layer = {v: k for k, v in _renames(hf_config).items()}
    out: dict[str, torch.Tensor] = {}
    expert_pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer prefix, fc1|fc2) → expert → tensor
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
        elif (expert := _EXPERT.fullmatch(suffix)) is not None:
            expert_pieces.setdefault((prefix, expert[2]), {})[int(expert[1])] = tensor
        else:
            raise ValueError(f"unexpected Megatron parameter {name!r}")
    for (prefix, fc), pieces in expert_pieces.items():
        if sorted(pieces) != list(range(len(pieces))):
            raise ValueError(f"{prefix}: experts {sorted(pieces)} are not 0..{len(pieces) - 1}")
        stacked = torch.stack([pieces[j] for j in range(len(pieces))])
        out[prefix + ("mlp.experts.gate_up_proj" if fc == "1" else "mlp.experts.down_proj")] = stacked
    if tied(hf_config) and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def transformer_config_kwargs(hf_config: Any, compute_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` arguments for a Qwen2 / Qwen3 / Llama HF config: float32
    parameters (initialised on the CPU); a 16-bit ``compute_dtype`` sets Megatron's bf16 / fp16 flag,
    which keeps the attention softmax in float32 (as HF's attention does) when the forward runs in it."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: only silu (gated) MLPs are converted")
    shape = AttentionShape.of(hf_config)
    return {
        **_moe_kwargs(hf_config),
        "num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
        "num_attention_heads": shape.heads, "num_query_groups": shape.groups, "kv_channels": shape.head_dim,
        "ffn_hidden_size": hf_config.intermediate_size, "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu, "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps, "add_bias_linear": False,
        "add_qkv_bias": hf_config.model_type == "qwen2", "qk_layernorm": has_qk_norm(hf_config),
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "bf16": compute_dtype == torch.bfloat16, "fp16": compute_dtype == torch.float16,
        # the HF models have no dropout after attention or MLP; Megatron's default of 0.1 would
        # train a different (noisier) policy than the engines sample from
        "hidden_dropout": 0.0, "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        # the fused causal softmax kernel (16-bit, on GPUs) ignores the attention mask it is given:
        # packed rows and context-parallel queries need theirs (kuberl.megatron.inputs)
        "masked_softmax_fusion": False,
    }  # fmt: skip


def _moe_kwargs(hf_config: Any) -> dict[str, Any]:
    """The router and experts of a Qwen3-MoE config. HF routes each token to the top-k of
    softmax(router logits), renormalised over those k when ``norm_topk_prob``: Megatron's softmax
    over the top-k logits (``moe_router_pre_softmax=False``) is the same; without renormalisation it
    is Megatron's softmax first (``pre_softmax=True``). No load-balancing loss (RL trains the policy
    the engines sample, and HF's forward adds none either). Tokens are exchanged by all-gather
    (megatron-core 0.16's all-to-all dispatcher needs CUDA streams)."""
    count = experts(hf_config)
    if not count:
        return {}
    return {"num_moe_experts": count, "moe_router_topk": hf_config.num_experts_per_tok,
            "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
            "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather"}  # fmt: skip
