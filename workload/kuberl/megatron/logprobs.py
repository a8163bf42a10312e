"""Per-token log-probs and entropy from Megatron's vocabulary-parallel logits.

Each tensor-parallel rank holds the logits of its slice of the vocabulary, ``l[..., V/t]``. For the
temperature-scaled policy π = softmax(l / T):

    log π(y) = l_y/T − log Σ_v exp(l_v/T)          (Megatron's vocab-parallel cross-entropy, negated:
                                                    differentiable, one all-reduce each for max, Σ)
    H(π)     = log S − Σ_v e_v (l_v/T − m) / S      with m = max_v l_v/T, e_v = exp(l_v/T − m), S = Σ_v e_v

the sums running over the whole vocabulary (all-reduced over the tensor-parallel group). The
entropy is a detached diagnostic, as in the FSDP actor (:func:`kuberl.policy.actor.token_logprobs_and_entropy`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call

from ..policy.batch import Batch
from .routing import replaying


def causal_mask(length: int) -> torch.Tensor:
    """Megatron's attention mask for one row: True where a query may NOT see a key (the future).
    Right padding needs nothing more: padded keys come after every real query."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


def vocab_parallel_logits(model: Any, batch: Batch, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model's logits for ``batch``, [B, L, V/t] on this tensor-parallel rank. A ``compute_dtype``
    other than the parameters' runs the forward on copies cast to it (``functional_call``): the
    backward flows through the casts, so the gradients land on the float32 parameters in float32 —
    FSDP2's mixed precision (``param_dtype``, float32 reduction and master weights) without FSDP.
    A mixture of experts routes as the batch's routes say, where it carries them (:mod:`.routing`)."""
    rows, length = batch.input_ids.shape
    positions = torch.arange(length, device=batch.input_ids.device).expand(rows, -1)
    mask = causal_mask(length).to(batch.input_ids.device).expand(rows, 1, length, length)
    with replaying(model, batch.routes):
        if compute_dtype == torch.float32:
            return model(batch.input_ids, positions, mask)
        cast = {name: p.to(compute_dtype) for name, p in model.named_parameters()}
        return functional_call(model, cast, (batch.input_ids, positions, mask))


def vocab_parallel_entropy(scaled: torch.Tensor, group: Any) -> torch.Tensor:
    """H(softmax(scaled)) over the whole vocabulary from this rank's slice (no gradient)."""
    with torch.no_grad():
        top = scaled.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = scaled - top.unsqueeze(-1)
        exps = shifted.exp()
        sums = torch.stack([exps.sum(-1), (exps * shifted).sum(-1)])
        dist.all_reduce(sums, group=group)
        return sums[0].log() - sums[1] / sums[0]


def token_logprobs_and_entropy(model: Any, batch: Batch, temperature: float,
                               compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), H(π)) at every position [B, L−1], as the FSDP actor computes them (the logits
    in ``compute_dtype``, the softmax over them in float32)."""
    return scores_of_logits(vocab_parallel_logits(model, batch, compute_dtype), batch.targets, temperature)


def scores_of_logits(logits: torch.Tensor, targets: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), H(π)) [B, L−1] from this rank's vocabulary-parallel ``logits`` [B, L, V/t]."""
    from megatron.core import parallel_state, tensor_parallel

    logits = logits[:, :-1].float()
    scaled = logits / temperature if temperature > 0 else logits * 1.0  # a fresh tensor: CE works in place
    entropy = vocab_parallel_entropy(scaled.detach(), parallel_state.get_tensor_model_parallel_group())
    logp = -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)
    return logp, entropy
