"""Micro-batches through megatron-core's pipeline schedule (1F1B, ``get_forward_backward_func``).

With pipeline parallelism a stage holds some of the layers: the first embeds the tokens, each sends
its output to the next, the last computes the logits — and the loss. Megatron's non-interleaved
schedule runs ``p − s − 1`` forwards ahead on stage s of p, then alternates one forward and one
backward, so at most p micro-batches' activations are alive on a stage. Its p2p buffers have one
shape for every micro-batch: the chunks are padded (:meth:`~kuberl.policy.batch.Batch.padded`) to
one rows × width, the same over the expert-parallel group and split evenly by the tensor-parallel
ranks under sequence parallelism (:func:`layout_shape`); the last stage reads each chunk's own
positions back out of the padded logits.

The loss is what ``on_logits`` makes of a chunk's logits, used as it is
(``calculate_per_token_loss``: Megatron divides by nothing; the actor's normaliser already makes the
sum of the chunks' losses the step's loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..devices import collective_device
from ..policy.batch import Batch
from .logprobs import vocab_parallel_logits

LogitsReader = Callable[[int, Batch, torch.Tensor], tuple[torch.Tensor, Any]]
"""(chunk index, chunk, its vocabulary-parallel logits [rows, width, V/t]) → (loss, what to keep)."""


def layout_shape(rows: int, width: int, sequence_parallel: bool) -> tuple[int, int]:
    """The shape to pad a batch of ``rows`` × ``width`` to for this rank's layout: the largest over
    its expert-parallel group (Megatron's all-gather token dispatcher exchanges equal blocks of
    tokens, while each data-parallel rank's share of a step has its own length), the width rounded
    up to a multiple of the tensor-parallel size under sequence parallelism (each rank takes an equal
    slice of the tokens). Every rank of the expert-parallel group calls it."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        shape = torch.tensor([rows, width], device=collective_device())  # NCCL reduces no CPU tensor
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        rows, width = int(shape[0]), int(shape[1])
    if sequence_parallel:
        tensor = parallel_state.get_tensor_model_parallel_world_size()
        width = -(-width // tensor) * tensor
    return rows, width


def through_pipeline(model: Any, chunks: list[Batch], on_logits: LogitsReader, compute_dtype: torch.dtype,
                     forward_only: bool) -> list[Any]:
    """Every chunk forward (and, unless ``forward_only``, backward: gradients add up in the
    parameters) through the pipeline; on the last stage, what ``on_logits`` kept of each chunk, in
    order; elsewhere an empty list. Every rank of the pipeline group calls it with as many chunks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, width = layout_shape(max(c.input_ids.shape[0] for c in chunks), max(c.input_ids.shape[1] for c in chunks),
                               model.config.sequence_parallel)
    padded = [c.padded(rows, width) for c in chunks]

    def forward_step(indices: Any, stage_model: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        i = next(indices)
        chunk_rows, chunk_width = chunks[i].input_ids.shape

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
            loss, kept = on_logits(i, chunks[i], logits[:chunk_rows, :chunk_width])
            return loss, torch.ones((), dtype=torch.int), kept

        return vocab_parallel_logits(stage_model, padded[i], compute_dtype), loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(range(len(chunks))), model=[model],
        num_microbatches=len(chunks), seq_length=width, micro_batch_size=rows, forward_only=forward_only)
