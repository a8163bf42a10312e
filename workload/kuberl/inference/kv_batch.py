"""The torch engine's KV cache: the keys and values of a batch of left-padded sequences.

Every row is right-aligned: its last cached token sits in the last column, and the columns before
its first token are padding (``mask`` 0). Rows leave (``select``) and join (``concat``) between
engine steps without recomputing anyone else's keys and values; a row's next position is the
number of its real tokens (``positions``). Pure tensor bookkeeping: the forward passes are the
engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

Row = TypeVar("Row")
LayerKV = tuple[torch.Tensor, torch.Tensor]  # (keys, values): [rows, kv heads, length, head dim]


@dataclass(frozen=True)
class KVBatch(Generic[Row]):
    rows: list[Row]
    layers: list[LayerKV]
    mask: torch.Tensor  # [rows, length] long: 1 for a cached token, 0 for left padding

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def positions(self) -> torch.Tensor:
        """[rows, 1]: the position of each row's next token (= its cached tokens)."""
        return self.mask.sum(-1, keepdim=True)


def left_padded(batch: KVBatch[Row], length: int) -> KVBatch[Row]:
    """``batch`` with ``length - batch.length`` padding columns in front (zeros, masked out)."""
    extra = length - batch.length
    if extra <= 0:
        return batch
    pad = torch.nn.functional.pad
    layers = [(pad(k, (0, 0, extra, 0)), pad(v, (0, 0, extra, 0))) for k, v in batch.layers]
    return KVBatch(batch.rows, layers, pad(batch.mask, (extra, 0)))


def trimmed(batch: KVBatch[Row]) -> KVBatch[Row]:
    """``batch`` without the leading columns that are padding in every row."""
    if not batch.rows:
        return batch
    used = batch.mask.any(0).nonzero()
    start = int(used[0]) if len(used) else batch.length
    if start == 0:
        return batch
    layers = [(k[:, :, start:], v[:, :, start:]) for k, v in batch.layers]
    return KVBatch(batch.rows, layers, batch.mask[:, start:])


def selected(batch: KVBatch[Row], keep: Sequence[int]) -> KVBatch[Row]:
    """The rows ``keep`` (indices, in that order), trimmed."""
    index = torch.tensor(list(keep), dtype=torch.long, device=batch.mask.device)
    layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in batch.layers]
    return trimmed(KVBatch([batch.rows[i] for i in keep], layers, batch.mask.index_select(0, index)))


def concat(first: KVBatch[Row], second: KVBatch[Row]) -> KVBatch[Row]:
    """``first``'s rows then ``second``'s, the shorter left-padded to the longer's length."""
    if not first.rows:
        return second
    if not second.rows:
        return first
    length = max(first.length, second.length)
    a, b = left_padded(first, length), left_padded(second, length)
    layers = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.layers, b.layers, strict=True)]
    return KVBatch(a.rows + b.rows, layers, torch.cat([a.mask, b.mask]))
