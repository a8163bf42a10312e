"""Collate trajectories into padded tensors, and split them into micro-batches by token budget,
rows of like length together (``micro_batches``): padding is compute thrown away.

Layout (right padding, L = longest prompt+output): ``input_ids`` [B, L]; everything per generated
token lives at the position that *predicts* it, in [B, L−1] coordinates: ``targets`` = input_ids
shifted left, ``loss_mask`` = 1 on output tokens the policy wrote (``Trajectory.trained``: tool
outputs and other context inside an episode are 0), ``behav_logp`` the engine's log-probs there,
``fresh_mask`` = 1 on output tokens sampled by the very weights being trained (version lag 0: there
the engine's log-probs must equal the trainer's own, which :mod:`.actor` checks).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import torch

from ..models.moe_routing import UNKNOWN as UNROUTED
from ..rollout.types import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor     # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor       # [B, L-1]
    loss_mask: torch.Tensor     # [B, L-1]
    behav_logp: torch.Tensor    # [B, L-1]
    advantages: torch.Tensor    # [B], or [B, L-1] per token (PPO's critic: :mod:`.critic`)
    fresh_mask: torch.Tensor    # [B, L-1]
    rewards: torch.Tensor       # [B]: each trajectory's reward
    routes: torch.Tensor        # [B, L, MoE layers, k] the engine's experts, −1 unknown; [B, L, 0, 0]: none

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | list[int]) -> Batch:
        return Batch(*(getattr(self, f.name)[rows] for f in fields(self)))

    def to(self, device: torch.device) -> Batch:
        """Every tensor on ``device`` (host-to-device copies overlap compute where pinned)."""
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's real length (prompt + output tokens): [B]."""
        return self.attention_mask.sum(dim=1)

    def by_length(self) -> Batch:
        """The rows, longest first (ties keep their order)."""
        return self.select(torch.argsort(self.lengths, descending=True, stable=True).tolist())

    def trimmed(self) -> Batch:
        """Without the padding columns no row needs (right padding: under a causal mask the real
        positions' outputs do not change)."""
        width = int(self.lengths.max())
        if width >= self.input_ids.shape[1]:
            return self
        full = self.input_ids.shape[1]
        return Batch(*(t if t.dim() == 1 else t[:, :width if t.shape[1] == full else width - 1]
                       for t in (getattr(self, f.name) for f in fields(self))))

    def masked(self) -> Batch:
        """A copy with nothing to learn (zero loss mask, advantages and rewards): filler that keeps
        collectives in step."""
        return Batch(self.input_ids, self.attention_mask, self.targets, torch.zeros_like(self.loss_mask),
                     self.behav_logp, torch.zeros_like(self.advantages), torch.zeros_like(self.fresh_mask),
                     torch.zeros_like(self.rewards), self.routes)


def collate(trajs: list[Trajectory], advantages: list[float], pad_id: int, version: int | None = None) -> Batch:
    """``version``: the version of the weights about to train on this batch (None: no token is fresh).
    Rows are padded as Python lists and each tensor is built in one call (row by row, torch's per-call
    overhead cost ≈ 20 µs a row: 2.7 ms of a 72 ms step of the main example)."""
    if not trajs:
        raise ValueError("cannot collate an empty batch")
    seqs = [t.prompt_ids + t.output_ids for t in trajs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
    attn = (torch.arange(width) < torch.tensor([len(s) for s in seqs])[:, None]).long()

    def per_output_token(values: list[list[float]]) -> torch.Tensor:
        """[B, L−1]: row i's values at the positions predicting its output tokens, 0 elsewhere."""
        return torch.tensor([[0.0] * (len(t.prompt_ids) - 1) + v + [0.0] * (width - len(s))
                             for t, s, v in zip(trajs, seqs, values, strict=True)], dtype=torch.float32)

    trained = [t.trained for t in trajs]
    fresh = [[float(v == version and m) for v, m in zip(t.versions, m_row, strict=True)]
             for t, m_row in zip(trajs, trained, strict=True)]
    return Batch(ids, attn, ids[:, 1:].clone(), per_output_token(trained),
                 per_output_token([t.behav_logprobs for t in trajs]), torch.tensor(advantages, dtype=torch.float32),
                 per_output_token(fresh), torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                 collate_routes(trajs, width))


def collate_routes(trajs: list[Trajectory], width: int) -> torch.Tensor:
    """[B, width, layers, k]: each trajectory's routes from position 0, −1 where it has none (its last
    token, padding, a trajectory without routes); [B, width, 0, 0] when none has any."""
    given = [t.routes for t in trajs if t.routes is not None]
    layers, k = tuple(given[0].shape[1:]) if given else (0, 0)
    routes = torch.full((len(trajs), width, layers, k), UNROUTED, dtype=torch.int16)
    for i, t in enumerate(trajs):
        if t.routes is not None:
            routes[i, :t.routes.shape[0]] = t.routes
    return routes


PASS_COST_TOKENS = 256
"""A forward+backward pass's fixed cost, in padded tokens (measured with the tiny model on one CPU
core: ~10-25 ms a pass, ~0.1 ms a token; a GPU's passes cost relatively more, so the figure errs high)."""


TOKEN_BUDGET = 16384
"""Padded tokens (rows × width) a micro-batch may hold, unless a single row is longer."""


def slice_bounds(rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` consecutive [lo, hi) row ranges of near-equal size covering ``rows`` rows (some
    empty when ``count`` > ``rows``)."""
    return list(itertools.pairwise(rows * i // count for i in range(count + 1)))


def padded_tokens(lengths: list[int]) -> int:
    """Tokens a slice of rows of ``lengths`` computes on, padded to its longest row."""
    return len(lengths) * max(lengths) if lengths else 0


def slice_count(lengths: list[int], token_budget: int = TOKEN_BUDGET, pass_cost: int = PASS_COST_TOKENS) -> int:
    """How many near-equal slices of rows sorted by ``lengths`` (longest first) cost the least:
    Σ :func:`padded_tokens` of each slice + ``pass_cost`` a slice, among the counts whose every slice
    keeps within ``token_budget`` (or is one row). Tried: the least count that fits, then doubling
    it. Rows of very different lengths (multi-turn episodes) get several slices even when one
    would fit: 128 rows of mean length 30 and longest 95 in one slice pay 12,160 tokens padded, in
    8 slices about 5,000."""
    lengths = sorted(lengths, reverse=True)
    rows = len(lengths)
    fits = max(1, -(-rows // max(1, token_budget // max(1, lengths[0]))))
    tried = {fits << k for k in range(rows.bit_length() + 1) if fits << k <= rows} | {fits}
    best, best_cost = fits, None
    for count in sorted(tried):
        slices = [lengths[lo:hi] for lo, hi in slice_bounds(rows, count) if hi > lo]
        tokens = [padded_tokens(s) for s in slices]
        if any(t > token_budget and len(s) > 1 for t, s in zip(tokens, slices, strict=True)):
            continue
        cost = sum(tokens) + count * pass_cost
        if best_cost is None or cost < best_cost:
            best, best_cost = count, cost
    return best


def micro_batch_count(batch: Batch, token_budget: int = TOKEN_BUDGET, pass_cost: int = PASS_COST_TOKENS) -> int:
    """``slice_count`` of the batch's row lengths: how many slices of ``batch.by_length()`` to train in."""
    return slice_count(batch.lengths.tolist(), token_budget, pass_cost)


def split(batch: Batch, parts: int) -> list[Batch]:
    """Exactly ``parts`` consecutive slices of near-equal size. Every data-parallel rank must run the
    same number of forward/backward passes (FSDP's collectives pair up by call), so a slice that
    would be empty is a masked copy of row 0 instead: it costs a pass and contributes nothing."""
    return [batch.select(slice(lo, hi)) if hi > lo else batch.select([0]).masked()
            for lo, hi in slice_bounds(batch.size, parts)]
