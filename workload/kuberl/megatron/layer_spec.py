"""The block spec the GPTModel is built from: megatron-core's local (non-Transformer-Engine) layer
spec, with torch's RMSNorm built where Megatron would build its own torch fallback.

Megatron's fallback (``WrappedTorchNorm``, used without Apex or Transformer Engine) refuses sequence
parallelism, which a mixture of experts needs with tensor parallelism. A norm works per token, so
on a slice of the sequence it is the same norm; what sequence parallelism changes is its gradient:
each tensor-parallel rank feeds it only its slice of the tokens, so the weight is marked
``sequence_parallel`` (as Megatron's own norms are) and :func:`.model.sum_partial_gradients` sums it
over the tensor-parallel ranks. q/k norms (Qwen3) are built the same way; they see every token but
only the rank's heads, and are summed over the ranks too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .context_parallel import context_parallel_attention


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as Megatron builds a norm (``config``, ``hidden_size``, ``eps``), its
    weight marked ``sequence_parallel`` when the model is."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _replaced(spec: Any, replacements: dict[type, type]) -> Any:
    """``spec`` (a ModuleSpec or submodules dataclass, walked recursively) with each module class
    that ``replacements`` names replaced."""
    if isinstance(spec, type) and spec in replacements:
        return replacements[spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _replaced(getattr(spec, f.name), replacements)
                                           for f in dataclasses.fields(spec) if f.init})  # fmt: skip
    return spec


def block_spec(config: Any) -> Any:
    """``TransformerBlockSubmodules`` for ``config`` on this pipeline stage: each of its layers the
    local spec (experts when ``config.num_moe_experts``, q/k norms when ``config.qk_layernorm``), the
    final norm and every norm inside the layers :class:`RMSNorm`; under context parallelism the
    attention :func:`.context_parallel.context_parallel_attention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    replacements: dict[type, type] = {WrappedTorchNorm: RMSNorm}
    if config.context_parallel_size > 1:
        replacements[DotProductAttention] = context_parallel_attention()
    layers = get_num_layers_to_build(config)  # this stage's
    return TransformerBlockSubmodules(layer_specs=[_replaced(layer, replacements)] * layers, layer_norm=RMSNorm)
