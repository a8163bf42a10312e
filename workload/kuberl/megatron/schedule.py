"""Micro-batches through megatron-core's pipeline schedule (1F1B, ``get_forward_backward_func``).

With pipeline parallelism a stage holds some of the layers: the first embeds the tokens, each sends
its output to the next, the last computes the logits — and the loss. Megatron's non-interleaved
schedule runs ``p − s − 1`` forwards ahead on stage s of p, then alternates one forward and one
backward, so at most p micro-batches' activations are alive on a stage. Its p2p buffers have one
shape for every micro-batch: the chunks are laid out (padded or packed) in one rows × width, the
same over the expert-parallel group and split evenly by the tensor-parallel ranks under sequence
parallelism and by the context-parallel ranks (:func:`.inputs.model_inputs`); the last stage reads
each chunk's own positions back out of its logits.

The loss is what ``on_scores`` makes of a chunk's log-probs and entropy, used as it is
(``calculate_per_token_loss``: Megatron divides by nothing; the actor's normaliser already makes the
sum of the chunks' losses the step's loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..policy.actor import ChunkReader
from ..policy.batch import Batch
from .inputs import model_inputs
from .logprobs import scores, vocab_parallel_logits


def through_pipeline(model: Any, chunks: list[Batch], on_scores: ChunkReader, temperature: float,
                     compute_dtype: torch.dtype, forward_only: bool, packed: bool = False) -> list[Any]:
    """Every chunk forward (and, unless ``forward_only``, backward: gradients add up in the
    parameters) through the pipeline; on the last stage, what ``on_scores`` kept of each chunk, in
    order; elsewhere an empty list. The chunks go in one shape (:func:`.inputs.model_inputs`, padded
    or ``packed``). Every rank of the pipeline group calls it with as many chunks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs = model_inputs(chunks, packed, model.config.sequence_parallel)
    rows, width = inputs[0].attention_mask.shape[0], inputs[0].attention_mask.shape[-1]  # whole rows: the
    # schedule divides the width by the context- (and, under sequence parallelism, tensor-) parallel size

    def forward_step(indices: Any, stage_model: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        i = next(indices)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
            loss, kept = on_scores(i, chunks[i], *scores(logits, inputs[i], temperature))
            return loss, torch.ones((), dtype=torch.int), kept

        return vocab_parallel_logits(stage_model, inputs[i], compute_dtype), loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(range(len(chunks))), model=[model],
        num_microbatches=len(chunks), seq_length=width, micro_batch_size=rows, forward_only=forward_only)
