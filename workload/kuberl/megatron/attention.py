"""The core attention of the local layer spec, computed by ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the scores of every head, [b, heads, s, s],
in the compute dtype (bfloat16 rounds them before the softmax), and keeps them and the
probabilities for the backward: O(s²) memory per layer, 4 GiB per layer for one 8k-token row of 32
heads. Without Transformer Engine (which this backend does not use) that is every attention.
:class:`SDPAttention <sdpa_attention>` keeps Megatron's interface and computes the same function
with torch's kernel — flash or memory-efficient attention on an accelerator (O(s) memory), a fused
kernel on the CPU — which is also the kernel the Hugging Face models behind the engines and the FSDP2
trainer call, so the two backends' attention agrees there bit for bit in 16 bits.

Contract (Megatron's): query [sq, b, heads, d], key and value [sk, b, groups, d]; ``attention_mask``
[b, 1, sq, sk], True where a query may NOT see a key, or None for a plain causal mask (sq = sk:
:attr:`kuberl.megatron.inputs.ModelInput.model_mask`); returns the context [sq, b, heads · d].
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch


def allowed(blocked: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (True: may attend) from Megatron's (True: may not), kept broadcastable where
    Megatron's is one mask expanded over the rows (stride 0: one row's mask, not R copies of it)."""
    return ~(blocked[:1] if blocked.stride(0) == 0 else blocked)


@functools.cache
def sdpa_attention() -> type:
    """The class (defined on first use: megatron-core is imported where it is needed)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):  # type: ignore[misc]
        """Megatron's local core attention through torch's scaled dot-product attention (module docstring)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            unsupported = [name for name, used in (
                ("softmax_type", config.softmax_type != "vanilla"), ("window_size", config.window_size is not None),
                ("apply_query_key_layer_scaling", config.apply_query_key_layer_scaling)) if used]
            if unsupported:
                raise ValueError(f"the local core attention does not implement {', '.join(unsupported)}")

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                    attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("the local core attention takes neither an attention bias nor packed-sequence "
                                 "parameters (packed rows come with a block-diagonal mask)")
            repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if repeats > 1:  # whole heads (as Megatron's attention does): every kernel takes them
                key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            dropout = self.attention_dropout.p if self.training else 0.0
            forked = (tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel
                      else contextlib.nullcontext())  # each tensor-parallel rank drops its heads' own way
            with forked:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else allowed(attention_mask), dropout_p=dropout,
                    is_causal=attention_mask is None, scale=self.softmax_scale)
            return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)

    return SDPAttention
