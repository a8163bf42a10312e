"""Sequence packing: a micro-batch's rows laid end to end in fewer rows, so the model computes on
real tokens instead of padding.

Layout: rows (prompt + output, real length n_i) go into bins of width W = the micro-batch's longest
row, first-fit decreasing; ``position_ids`` restart at 0 with every sequence (and for a bin's tail
of padding), and no attention mask is passed, so each token attends only to its own sequence:
transformers builds the block-diagonal causal mask from the position ids (sdpa, eager), and
flash-attention's variable-length path reads them the same way. The micro-batches are the padded
path's (rows of like length together, :meth:`.actor.Actor._micro_batches`), so attention — dense
over a bin's W × W wherever the mask is built — never costs more than padded (bins ≤ rows, same
width), and every other layer costs bins × W instead of rows × W. (Sizing micro-batches by packed
tokens instead puts short rows into bins as wide as the longest row: fewer passes but more
attention; on a long-tailed batch it was slower than padding on both backends,
``benchmarks/packing.py``.)

What the model says at packed position (bin b, offset o + j) is what the padded path says at (row i,
j) for j < n_i − 1 (it predicts the row's token j + 1); :meth:`Packing.unpack` puts it back there, so
every loss, mask and sequence-level term downstream works on the padded [B, L−1] layout unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import UNROUTED, Batch


def first_fit_bins(lengths: list[int], width: int) -> list[list[int]]:
    """Row indices grouped into bins whose lengths add up to at most ``width`` (a row longer than
    ``width`` gets a bin of its own), longest rows placed first, each into the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, free in enumerate(room) if free >= lengths[row]), None)
        if slot is None:
            bins.append([row])
            room.append(width - lengths[row])
        else:
            bins[slot].append(row)
            room[slot] -= lengths[row]
    return bins


def packed_tokens(lengths: list[int]) -> int:
    """Tokens (bins × width) the packed layout of rows of ``lengths`` computes on."""
    return len(first_fit_bins(lengths, max(lengths))) * max(lengths) if lengths else 0


@dataclass(frozen=True)
class Packing:
    """A batch packed: ``input_ids`` and ``position_ids`` [R, W] (``routes`` [R, W, layers, k] alike);
    ``source`` / ``destination``: flat indices into [R, W−1] and [B, L−1] of the positions that
    predict a real next token."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor
    destination: torch.Tensor
    padded_shape: tuple[int, int]  # (B, L−1)
    routes: torch.Tensor

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[R, W−1] per-position values → [B, L−1], zero where the padded layout has padding
        (differentiable: gradients flow back to the packed positions)."""
        out = packed.new_zeros(self.padded_shape[0] * self.padded_shape[1])
        out = out.index_put((self.destination,), packed.reshape(-1)[self.source])
        return out.view(self.padded_shape)


def pack(batch: Batch) -> Packing:
    """``batch``'s rows in first-fit bins of its longest row's width (module docstring). The layout is
    planned on the host from the row lengths; the tokens are gathered where the batch lives, in one
    indexing (no per-row copy off an accelerator)."""
    lengths = [int(n) for n in batch.lengths.tolist()]
    rows, padded_width = batch.input_ids.shape
    width = max(lengths)
    bins = first_fit_bins(lengths, width)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    # flat indices: tokens taken from [B, L] and placed in [R, W]; outputs from [R, W−1] back to [B, L−1]
    taken: list[torch.Tensor] = []
    placed: list[torch.Tensor] = []
    source: list[torch.Tensor] = []
    destination: list[torch.Tensor] = []
    for b, members in enumerate(bins):
        offset = 0
        for row in members:
            n = lengths[row]
            positions[b, offset:offset + n] = torch.arange(n)
            taken.append(row * padded_width + torch.arange(n))
            placed.append(b * width + offset + torch.arange(n))
            source.append(b * (width - 1) + offset + torch.arange(n - 1))
            destination.append(row * (padded_width - 1) + torch.arange(n - 1))
            offset += n
        positions[b, offset:] = torch.arange(width - offset)  # the tail: a sequence of its own
    device = batch.input_ids.device
    into, out_of = torch.cat(placed).to(device), torch.cat(taken).to(device)
    ids = batch.input_ids.new_zeros(len(bins) * width)
    ids[into] = batch.input_ids.reshape(-1)[out_of]
    per_token = batch.routes.shape[2:]
    routes = batch.routes.new_full((len(bins) * width, *per_token), UNROUTED)
    routes[into] = batch.routes.reshape(rows * padded_width, *per_token)[out_of]
    return Packing(ids.view(len(bins), width), positions.to(device), torch.cat(source).to(device),
                   torch.cat(destination).to(device), (rows, padded_width - 1),
                   routes.view(len(bins), width, *per_token))
