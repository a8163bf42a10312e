"""What a Megatron forward is given for a batch, and how its per-position outputs go back to the
batch's [B, L−1] layout.

A batch's rows (right-padded, [B, L]) reach the model in one of two layouts:

- **padded**: the rows as they are, under a causal mask;
- **packed** (``spec.trainer.packing``): the rows laid end to end in bins (:mod:`kuberl.policy.packing`)
  under a block-diagonal causal mask (:func:`attention_mask`: a token sees the earlier tokens of its own
  sequence only). Megatron's rotary embedding numbers a bin's positions 0…W−1 whatever the position
  ids say, so a sequence at offset o of its bin is rotated as if it began at o; its scores are the
  same as at 0 because a rotary attention score depends only on the distance between query and key,
  qᵀR(i)ᵀR(j)k = qᵀR(j − i)k (to float rounding).

Either is padded to the shape the parallel layout takes (:func:`layout_shape`). Under context
parallelism each rank is given only its positions of every row (:mod:`.context_parallel`) and the
mask of its queries over the whole row's keys; :meth:`ModelInput.read` gathers a per-position
output back into whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..devices import collective_device
from ..models.moe_routing import UNKNOWN as UNROUTED
from ..policy.batch import Batch
from ..policy.packing import Packing, pack
from .context_parallel import context_group, context_positions, gather_positions


def layout_shape(rows: int, width: int, sequence_parallel: bool) -> tuple[int, int]:
    """The shape to pad ``rows`` × ``width`` to for this rank's layout: the largest over its
    expert-parallel group (Megatron's all-gather token dispatcher exchanges equal blocks of tokens,
    while each data-parallel rank's share of a step has its own length), the width rounded up to a
    multiple of 2c under context parallelism c (:func:`.context_parallel.context_positions`), times
    the tensor-parallel size t under sequence parallelism (each rank's W ÷ c positions split evenly
    over t). Every rank of the expert-parallel group calls it."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        shape = torch.tensor([rows, width], device=collective_device())  # NCCL reduces no CPU tensor
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        rows, width = int(shape[0]), int(shape[1])
    _, context, _ = context_group()
    multiple = (2 * context if context > 1 else 1) * (
        parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1)
    return rows, -(-width // multiple) * multiple


def attention_mask(position_ids: torch.Tensor, queries: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """Megatron's attention mask [R, 1, q, W] for rows whose ``position_ids`` are [R, W]: True where a
    query (the positions ``queries`` of the row, every position when None) may NOT see a key — a
    later position, or (``packed``: position ids restart at 0 with each sequence) another sequence.
    Right padding needs nothing more: padded keys come after every real query."""
    rows, width = position_ids.shape
    keys = torch.arange(width, device=position_ids.device)
    queries = keys if queries is None else queries.to(position_ids.device)
    blocked = keys[None, :] > queries[:, None]  # [q, W]: the future
    if not packed:
        return blocked[None, None].expand(rows, 1, -1, -1)
    sequence = (position_ids == 0).cumsum(dim=1)
    return (blocked | (sequence[:, queries, None] != sequence[:, None, :]))[:, None]


@dataclass(frozen=True)
class ModelInput:
    """One forward's input for this rank — ``input_ids``, ``position_ids`` [R, w] (w = W ÷ c, this
    rank's positions; W under no context parallelism), ``attention_mask`` [R, 1, w, W] (this rank's
    queries, every key of the row: :func:`attention_mask`), ``routes`` [R, w, layers, k] — with
    ``targets`` [R, w], the token after each position (0 after a row's last), and how to read an
    output back (:meth:`read`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    routes: torch.Tensor
    targets: torch.Tensor
    batch_shape: tuple[int, int]  # the batch's (B, L − 1)
    packing: Packing | None

    @property
    def model_mask(self) -> torch.Tensor | None:
        """The mask the model is given: None — Megatron's plain causal mask, which lets the attention
        kernel skip the masked half (:mod:`.attention`) — where every query sees exactly the keys up to
        its own (the padded layout, no context parallelism), else :attr:`attention_mask`."""
        queries, keys = self.attention_mask.shape[-2:]
        return None if self.packing is None and queries == keys else self.attention_mask

    def read(self, per_position: torch.Tensor) -> torch.Tensor:
        """This rank's [R, w] per-position values → the batch's [B, L − 1] (differentiable): gathered
        into whole rows under context parallelism (each rank then holds the same values and keeps
        only its own positions' gradient), then unpacked or cut back to the batch's rows."""
        whole = gather_positions(per_position, 1, sum_gradients=False)
        if self.packing is None:
            rows, positions = self.batch_shape
            return whole[:rows, :positions]
        bins, width = self.packing.input_ids.shape
        return self.packing.unpack(whole[:bins, :width - 1])


def _laid_out(batch: Batch, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Packing | None]:
    """(input_ids, position_ids, routes, packing) of ``batch`` in the padded or the packed layout."""
    if packed:
        packing = pack(batch)
        return packing.input_ids, packing.position_ids, packing.routes, packing
    rows, width = batch.input_ids.shape
    positions = torch.arange(width, device=batch.input_ids.device).expand(rows, -1)
    return batch.input_ids, positions, batch.routes, None


def _grown(tensor: torch.Tensor, rows: int, width: int, fill: int | torch.Tensor) -> torch.Tensor:
    """``tensor`` [r, w, …] in the top-left corner of a [rows, width, …] one filled with ``fill``."""
    out = (fill.clone() if isinstance(fill, torch.Tensor)
           else tensor.new_full((rows, width, *tensor.shape[2:]), fill))
    out[:tensor.shape[0], :tensor.shape[1]] = tensor
    return out


def model_inputs(chunks: list[Batch], packed: bool, sequence_parallel: bool) -> list[ModelInput]:
    """Each chunk's :class:`ModelInput`, all of one shape (:func:`layout_shape` of the largest: a
    pipeline's buffers take one shape); padding rows and columns are token 0 and, as positions, carry
    on counting, so under either mask they change no real position's output."""
    laid = [_laid_out(chunk, packed) for chunk in chunks]
    rows, width = layout_shape(max(ids.shape[0] for ids, *_ in laid), max(ids.shape[1] for ids, *_ in laid),
                               sequence_parallel)
    rank, size, _ = context_group()
    mine = context_positions(width, size, rank) if size > 1 else None
    inputs = []
    for chunk, (ids, positions, routes, packing) in zip(chunks, laid, strict=True):
        device = ids.device
        ids = _grown(ids, rows, width, 0)
        positions = _grown(positions, rows, width, torch.arange(width, device=device).expand(rows, -1))
        routes = _grown(routes, rows, width, UNROUTED)
        mask = attention_mask(positions, mine, packing is not None)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        if mine is not None:
            at = mine.to(device)
            ids, positions, routes, targets = (t.index_select(1, at) for t in (ids, positions, routes, targets))
        inputs.append(ModelInput(ids, positions, mask, routes, targets, tuple(chunk.targets.shape), packing))
    return inputs
