"""The p2p weight-exchange planner: which bytes go from which trainer rank to which inference rank.

Pure: no torch, no I/O. Inputs are *holdings* (trainer rank r holds ``param[box]``), *needs*
(inference rank d needs ``param[box]`` placed at ``dest[dest_box]`` of its own tensors) and the
topology of every rank (node / fabric / zone, from the ``kuberl.io/*`` pod labels). Output is a
schedule of :class:`Transfer` s such that

- every element every inference rank needs arrives exactly once, from a rank that holds it;
- each piece comes from the nearest tier of holders (same node < same fabric < same zone <
  elsewhere; :func:`tier`);
- among equally near holders the bytes are split (whole slices along the piece's longest
  dimension) so that the busiest sender port carries as little as possible: demands are placed
  most-constrained first, each one water-filled over its candidates (optimal for the laminar
  candidate families that node ⊂ fabric ⊂ zone labels produce, up to one slice).

Cost model (:class:`Bandwidths`): every rank has a *local* port (same-node transfers: NVLink,
HCCS, shared memory) and a *network* port (its NIC), each full duplex. A byte sent at tier t costs
1/B_t seconds on the sender's and on the receiver's port of that class. A schedule's predicted time
is the busiest port's busy time; ``Plan.lower_bound_seconds`` is the smallest busiest-port time any
schedule that respects the tier preference can reach (receiver ports are fixed by the needs;
sender ports by Hall's bound max_S W(S)/|S| over the candidate sets S).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]  # per dimension a half-open [start, stop)

TIER_NAMES = ("node", "fabric", "zone", "cross")


class PlanError(ValueError):
    """A need cannot be served (no rank holds part of it); the message names the param and box."""


@dataclass(frozen=True)
class RankTopology:
    node: str
    fabric: str = ""
    zone: str = ""


@dataclass(frozen=True)
class Holding:
    rank: int
    param: str
    box: Box  # the region of the full parameter this rank's local tensor holds


@dataclass(frozen=True)
class Need:
    rank: int
    dest: str  # the inference rank's own tensor name (may be a fused one, e.g. qkv_proj)
    dest_box: Box  # where the bytes go in that local tensor
    param: str  # the trainer-side parameter they come from
    box: Box  # which region of it (same shape as dest_box)


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    param: str
    box: Box  # region of the full parameter
    src_box: Box  # the same region in the sender's local tensor
    dest: str
    dest_box: Box  # and in the receiver's local tensor
    nbytes: int


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second per port and direction, by tier (see :data:`TIER_NAMES`)."""

    node: float
    fabric: float
    zone: float
    cross: float

    def of(self, t: int) -> float:
        return (self.node, self.fabric, self.zone, self.cross)[t]

    @classmethod
    def uniform(cls, bytes_per_second: float = 1.0) -> Bandwidths:
        return cls(bytes_per_second, bytes_per_second, bytes_per_second, bytes_per_second)


@dataclass
class Plan:
    transfers: list[Transfer]
    ranks: dict[int, RankTopology]
    lower_bound_seconds: float  # see _lower_bound, with the bandwidths the plan was made for

    def bytes_sent(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.nbytes
        return dict(out)

    def bytes_received(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.nbytes
        return dict(out)

    def for_rank(self, rank: int) -> list[Transfer]:
        """This rank's part of the schedule (sends and receives), in schedule order."""
        return [t for t in self.transfers if rank in (t.src, t.dst)]


# ---- boxes ---------------------------------------------------------------------------------


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a tensor that holds the region ``origin``."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def translate(box: Box, src_origin: Box, dst_origin: Box) -> Box:
    """Map ``box`` (inside ``src_origin``) onto the matching part of ``dst_origin`` (same shape)."""
    return tuple((a - s + d, b - s + d) for (a, b), (s, _), (d, _) in zip(box, src_origin, dst_origin, strict=True))


def _cells(boxes: list[Box]) -> list[Box]:
    """The coarsest grid of disjoint boxes such that each of ``boxes`` is a union of cells."""
    ndim = len(boxes[0])
    cuts = [sorted({c for b in boxes for c in b[d]}) for d in range(ndim)]
    cells: list[Box] = [()]
    for d in range(ndim):
        cells = [(*c, (lo, hi)) for c in cells for lo, hi in zip(cuts[d], cuts[d][1:], strict=False)]
    return [c for c in cells if any(contains(b, c) for b in boxes)]


class _Grid:
    """A parameter's holder cells, looked up by dimension-0 overlap."""

    def __init__(self, held: list[Holding]):
        cells = _cells(sorted({h.box for h in held}))
        self.cells = sorted((c, [h.rank for h in held if contains(h.box, c)]) for c in cells)
        self.stops = [c[0][1] for c, _ in self.cells]

    def overlapping(self, box: Box) -> list[tuple[Box, list[int]]]:
        lo, hi = box[0]
        i = bisect.bisect_right(self.stops, lo)  # first cell that ends after lo
        out = []
        while i < len(self.cells) and self.cells[i][0][0][0] < hi:
            out.append(self.cells[i])
            i += 1
        return out


# ---- topology ------------------------------------------------------------------------------


def tier(a: RankTopology, b: RankTopology) -> int:
    """0 same node, 1 same fabric, 2 same zone, 3 elsewhere (empty labels never match)."""
    if a.node == b.node:
        return 0
    if a.fabric and a.fabric == b.fabric:
        return 1
    if a.zone and a.zone == b.zone:
        return 2
    return 3


def _port(t: int) -> str:
    return "local" if t == 0 else "net"


# ---- planning ------------------------------------------------------------------------------


@dataclass
class _Demand:
    need: Need
    piece: Box  # region of the full parameter
    candidates: tuple[int, ...]  # nearest holders
    tier: int
    itemsize: int


def _demands(
    holdings: list[Holding], needs: list[Need], ranks: dict[int, RankTopology], itemsize: dict[str, int]
) -> list[_Demand]:
    by_param: dict[str, list[Holding]] = defaultdict(list)
    for h in holdings:
        if volume(h.box) > 0:
            by_param[h.param].append(h)
    grids: dict[str, _Grid] = {}
    out: list[_Demand] = []
    for need in needs:
        held = by_param.get(need.param)
        if not held:
            raise PlanError(f"no trainer rank holds parameter {need.param!r} (needed by rank {need.rank})")
        if need.param not in grids:
            grids[need.param] = _Grid(held)
        covered = 0
        for cell, holders in grids[need.param].overlapping(need.box):
            piece = intersect(cell, need.box)
            if piece is None:
                continue
            covered += volume(piece)
            tiers = [tier(ranks[need.rank], ranks[h]) for h in holders]
            best = min(tiers)
            cands = tuple(sorted(h for h, t in zip(holders, tiers, strict=True) if t == best))
            out.append(_Demand(need, piece, cands, best, itemsize[need.param]))
        if covered != volume(need.box):
            raise PlanError(
                f"parameter {need.param!r} region {need.box} needed by rank {need.rank} is not fully held by any "
                f"trainer rank ({covered} of {volume(need.box)} elements are)"
            )
    return out


def _longest_dim(box: Box) -> int:
    return max(range(len(box)), key=lambda d: box[d][1] - box[d][0])


def _split(piece: Box, amounts: list[int]) -> list[Box]:
    """Cut ``piece`` along its longest dimension into consecutive parts of ``amounts`` slices."""
    dim = _longest_dim(piece)
    start = piece[dim][0]
    parts = []
    for n in amounts:
        parts.append((*piece[:dim], (start, start + n), *piece[dim + 1 :]) if n else ())
        start += n
    return parts


def split_evenly(piece: Box, parts: int) -> list[Box]:
    """``piece`` cut along its longest dimension into ``parts`` near-equal consecutive pieces (fewer when that
    dimension is shorter)."""
    lo, hi = piece[_longest_dim(piece)]
    amounts = [(hi - lo) * (k + 1) // parts - (hi - lo) * k // parts for k in range(parts)]
    return [p for p in _split(piece, amounts) if p]


def _water_fill(loads: list[float], slices: int, slice_cost: float) -> list[int]:
    """Give ``slices`` units of ``slice_cost`` to the ports with ``loads`` so the max is smallest."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    total = slices * slice_cost
    level = loads[order[0]]
    k = 0
    for k in range(1, len(order) + 1):  # raise the k lowest ports to a common level
        level = (sum(loads[i] for i in order[:k]) + total) / k
        if k == len(order) or level <= loads[order[k]]:
            break
    amounts = [0] * len(loads)
    for i in order[:k]:
        amounts[i] = max(0, math.floor((level - loads[i]) / slice_cost)) if slice_cost else 0
    for _ in range(slices - sum(amounts)):  # the rounding remainder, one slice each to the least loaded
        i = min(range(len(loads)), key=lambda j: loads[j] + amounts[j] * slice_cost)
        amounts[i] += 1
    return amounts


def plan(
    holdings: list[Holding],
    needs: list[Need],
    ranks: dict[int, RankTopology],
    itemsize: dict[str, int],
    bandwidths: Bandwidths | None = None,
) -> Plan:
    """The transfer schedule (see the module docstring for its guarantees)."""
    bw = bandwidths or Bandwidths.uniform()
    demands = _demands(holdings, needs, ranks, itemsize)
    origins: dict[tuple[int, str], list[Box]] = defaultdict(list)
    for h in holdings:
        origins[(h.rank, h.param)].append(h.box)
    bound = _lower_bound(demands, bw)
    demands.sort(key=lambda d: (len(d.candidates), -volume(d.piece) * d.itemsize))
    send_load: dict[tuple[int, str], float] = defaultdict(float)
    transfers: list[Transfer] = []
    for d in demands:
        cost = d.itemsize / bw.of(d.tier)
        port = _port(d.tier)
        if len(d.candidates) == 1:
            parts = [(d.candidates[0], d.piece)]
        else:
            lo, hi = d.piece[_longest_dim(d.piece)]
            n = hi - lo
            slice_cost = cost * volume(d.piece) / n
            amounts = _water_fill([send_load[(c, port)] for c in d.candidates], n, slice_cost)
            parts = [(c, p) for c, p in zip(d.candidates, _split(d.piece, amounts), strict=True) if p]
        for src, piece in parts:
            src_origin = next(b for b in origins[(src, d.need.param)] if contains(b, piece))
            nbytes = volume(piece) * d.itemsize
            send_load[(src, port)] += nbytes / bw.of(d.tier)
            transfers.append(
                Transfer(
                    src=src,
                    dst=d.need.rank,
                    param=d.need.param,
                    box=piece,
                    src_box=relative(piece, src_origin),
                    dest=d.need.dest,
                    dest_box=translate(piece, d.need.box, d.need.dest_box),
                    nbytes=nbytes,
                )
            )
    transfers.sort(key=lambda t: (t.src, t.dst, t.param, t.box))
    return Plan(transfers, dict(ranks), bound)


# ---- cost model and bound ------------------------------------------------------------------


def port_seconds(p: Plan, bw: Bandwidths) -> dict[tuple[int, str, str], float]:
    """Busy seconds per (rank, port class, direction ``out``/``in``)."""
    busy: dict[tuple[int, str, str], float] = defaultdict(float)
    for t in p.transfers:
        ti = tier(p.ranks[t.src], p.ranks[t.dst])
        seconds = t.nbytes / bw.of(ti)
        busy[(t.src, _port(ti), "out")] += seconds
        busy[(t.dst, _port(ti), "in")] += seconds
    return dict(busy)


def predicted_seconds(p: Plan, bw: Bandwidths) -> float:
    busy = port_seconds(p, bw)
    return max(busy.values(), default=0.0)


def _lower_bound(demands: list[_Demand], bw: Bandwidths) -> float:
    """The least busiest-port seconds of any schedule that takes every piece from its nearest holders.

    Receiver ports: fixed by the needs. Sender ports: for each candidate set S, the work of all
    demands whose candidates lie inside S must be done by |S| ports: W(S)/|S|.
    """
    inbound: dict[tuple[int, str], float] = defaultdict(float)
    work: dict[tuple[str, tuple[int, ...]], float] = defaultdict(float)
    for d in demands:
        seconds = volume(d.piece) * d.itemsize / bw.of(d.tier)
        inbound[(d.need.rank, _port(d.tier))] += seconds
        work[(_port(d.tier), d.candidates)] += seconds
    bound = max(inbound.values(), default=0.0)
    for port, outer in {(p, frozenset(c)) for p, c in work}:
        inside = sum(w for (p, c), w in work.items() if p == port and outer.issuperset(c))
        bound = max(bound, inside / len(outer))
    return bound
