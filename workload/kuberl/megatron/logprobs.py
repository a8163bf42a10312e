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
from .inputs import ModelInput, model_inputs
from .routing import replaying


def vocab_parallel_logits(model: Any, given: ModelInput, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model's logits for ``given``, [R, w, V/t] on this tensor-parallel rank. A ``compute_dtype``
    other than the parameters' runs the forward on copies cast to it (``functional_call``): the
    backward flows through the casts, so the gradients land on the float32 parameters in float32 —
    FSDP2's mixed precision (``param_dtype``, float32 reduction and master weights) without FSDP.
    A mixture of experts routes as the input's routes say, where it carries them (:mod:`.routing`)."""
    args = (given.input_ids, given.position_ids, given.model_mask)
    with replaying(model, given.routes):
        if compute_dtype == torch.float32:
            return model(*args)
        cast = {name: p.to(compute_dtype) for name, p in model.named_parameters()}
        return functional_call(model, cast, args)


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


def token_logprobs_and_entropy(model: Any, batch: Batch, temperature: float, compute_dtype: torch.dtype = torch.float32,
                               packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), H(π)) at every position [B, L−1], as the FSDP actor computes them (the logits
    in ``compute_dtype``, the softmax over them in float32), through the padded or packed layout
    (:mod:`.inputs`)."""
    given = model_inputs([batch], packed, model.config.sequence_parallel)[0]
    return scores(vocab_parallel_logits(model, given, compute_dtype), given, temperature)


def scores(logits: torch.Tensor, given: ModelInput, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), H(π)) in the batch's [B, L−1] layout from this rank's vocabulary-parallel
    ``logits`` [R, w, V/t] of ``given`` (:meth:`.inputs.ModelInput.read`)."""
    from megatron.core import parallel_state, tensor_parallel

    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits * 1.0  # a fresh tensor: CE works in place
    entropy = vocab_parallel_entropy(scaled.detach(), parallel_state.get_tensor_model_parallel_group())
    logp = -tensor_parallel.vocab_parallel_cross_entropy(scaled, given.targets)
    return given.read(logp), given.read(entropy)
