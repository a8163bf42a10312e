"""The block spec the GPTModel is built from: megatron-core's local (non-Transformer-Engine) layer
spec, with torch's RMSNorm built where Megatron would build its own torch fallback, torch's scaled
dot-product attention as the core attention (:mod:`.attention`) and experts that apply the routing
weights to their outputs — in 16 bits the trainer then rounds as the engines' models do (norms, attention,
experts: each the same function as Megatron's, computed in the order the Hugging Face models and
vLLM compute it), so that their log-probs differ as little as kernels allow.

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
import functools
from typing import Any

import torch

from .attention import sdpa_attention
from .context_parallel import context_parallel_attention


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as Megatron builds a norm (``config``, ``hidden_size``, ``eps``), its
    weight marked ``sequence_parallel`` when the model is, computed as the Hugging Face models (and
    vLLM's kernel) compute it: y = w · round(x / √(mean(x²) + ε)), the normalisation in float32 and
    rounded to x's dtype before the weight multiplies it (torch's rounds once, after the weight: in
    16 bits the two differ in the last bit)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normalised = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalised.to(x.dtype)


@functools.cache
def experts_weighted_after() -> type:
    """megatron-core's ``SequentialMLP`` computing y = Σ_k w_k · E_k(x) as the Hugging Face models
    and vLLM do: each routing weight applies to its expert's output, in the compute dtype, and the k
    products are handed on in float32, so that the combine sums them in float32 (rounded once, by
    :func:`moe_layer_rounded_once`). megatron-core scales the activations inside the expert instead
    (w_k · h before the down projection) and sums in the compute dtype: the same function, rounded
    differently in 16 bits. (Defined on first use: megatron-core is imported where it is needed.)"""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class ExpertsWeightedAfter(SequentialMLP):  # type: ignore[misc]
        def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor, None]:
            output, bias = super().forward(tokens, tokens_per_expert, torch.ones_like(probs))
            if bias is not None:
                raise ValueError("experts with a bias are not converted")
            return (output * probs.unsqueeze(-1).to(output.dtype)).float(), None

    return ExpertsWeightedAfter


@functools.cache
def moe_layer_rounded_once() -> type:
    """megatron-core's ``MoELayer`` whose output, the float32 sum of a token's weighted experts
    (:func:`experts_weighted_after`), returns in its input's dtype. The partial sums of the
    tensor- and expert-parallel ranks are added in float32 too: megatron-core's all-gather
    dispatcher reduce-scatters them in the routing probabilities' dtype (the compute dtype)."""
    from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class MoELayerRoundedOnce(MoELayer):  # type: ignore[misc]
        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            output, bias = super().forward(hidden_states, *args, **kwargs)
            return output.to(hidden_states.dtype), bias

        def combine(self, output: torch.Tensor) -> torch.Tensor:
            dispatcher = self.token_dispatcher
            if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
                return super().combine(output)
            if dispatcher.tp_size > 1 or dispatcher.ep_size > 1:  # as its token_combine, without the cast
                return reduce_scatter_to_sequence_parallel_region(output, group=dispatcher.tp_ep_group)
            return output

    return MoELayerRoundedOnce


def replaced(spec: Any, replacements: dict[type, type]) -> Any:
    """``spec`` (a ModuleSpec or submodules dataclass, or a list of them, walked recursively) with each
    module class that ``replacements`` names replaced."""
    if isinstance(spec, type) and spec in replacements:
        return replacements[spec]
    if isinstance(spec, list):
        return [replaced(item, replacements) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: replaced(getattr(spec, f.name), replacements)
                                           for f in dataclasses.fields(spec) if f.init})  # fmt: skip
    return spec


def block_spec(config: Any) -> Any:
    """``TransformerBlockSubmodules`` for ``config`` on this pipeline stage: each of its layers the
    local spec (experts when ``config.num_moe_experts``, q/k norms when ``config.qk_layernorm``), the
    final norm and every norm inside the layers :class:`RMSNorm`, the experts
    :func:`experts_weighted_after`, the core attention torch's
    (:func:`.attention.sdpa_attention`; under context parallelism
    :func:`.context_parallel.context_parallel_attention`, which gathers for it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    attention = context_parallel_attention() if config.context_parallel_size > 1 else sdpa_attention()
    replacements: dict[type, type] = {WrappedTorchNorm: RMSNorm, DotProductAttention: attention,
                                      SequentialMLP: experts_weighted_after(), MoELayer: moe_layer_rounded_once()}
    layers = get_num_layers_to_build(config)  # this stage's
    return TransformerBlockSubmodules(layer_specs=[replaced(layer, replacements)] * layers, layer_norm=RMSNorm)
