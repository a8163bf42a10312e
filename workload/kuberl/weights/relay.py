"""Relaying through the replicas: a two-stage p2p schedule for pools larger than the trainer.

The direct schedule (:func:`~kuberl.weights.plan.plan`) takes every piece every inference rank needs
from the trainer ranks that hold it. When R receivers need the same pieces and the trainer has
fewer network ports than that, each trainer port carries about R ÷ T copies of its share — more
than a pipelined broadcast, whose chain carries the model once per link (measured:
``benchmarks/weight_sync.py``, 2 trainer and 4 replica nodes). The relayed schedule sends each
distinct piece into the pool once and lets the pool spread it:

1. the needs are grouped by what they ask for (parameter and region); each group gets one *seed*,
   the rank of the group with the fewest seeded bytes so far (groups largest first), so the pool's
   ranks seed about equal shares — a region larger than one rank's equal share is cut into pieces,
   each with a seed of its own (an embedding seeded whole made its seed the bottleneck of stage 2:
   predicted 0.40 s against 0.18 s for a pipelined broadcast of 8.8 GB to 32 receivers);
2. stage 1 is the direct planner over the seeds' needs alone; stage 2 is the direct planner over
   the other needs, with each seed holding what it received (``Holding(seed, param, box)``: its
   tensor for that parameter is the region of its own destination tensor the piece landed in).

A rank starts stage 2 when its own stage 1 is done. Predicted time = the sum of the stages'
(:func:`~kuberl.weights.plan.predicted_seconds`); :func:`staged_plan` keeps the direct schedule
unless the relayed one is predicted at least 10 % faster — with uniform ports, relaying pays when the
trainer has fewer ports than the receivers (direct R·M ÷ T per trainer port; relayed ≈ M ÷ T +
M·(R − 1) ÷ R), and where receivers that need the same pieces share a node (stage 2 runs on its
local links).

``kuberl.weights.transport.run_staged`` carries a staged schedule out (stage after stage on each
rank); ``benchmarks/weight_sync.py`` measures it (``p2p-relay``). The live exchange
(:mod:`kuberl.weights.p2p`) uses it when ``spec.weightSync.relay`` is on: stage 2 makes each replica
depend on its seeds, so a seed that fails or hangs costs that version on the replicas it feeds (they
get it by broadcast; ``InferenceClient.receive_p2p`` with ``relayed``), which is why it is opt-in.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from .plan import (
    Bandwidths,
    Box,
    Holding,
    Need,
    Plan,
    RankTopology,
    Transfer,
    plan,
    predicted_seconds,
    split_evenly,
    translate,
    volume,
)

RELAY_GAIN = 0.1  # the predicted share of the direct schedule's time relaying must save


@dataclass(frozen=True)
class StagedPlan:
    """Stages run in order on every rank (a stage with nothing for a rank is skipped by it);
    ``relay_sources[rank]``: what a seed forwards in stage 2, as (parameter, its destination tensor,
    the region of it the parameter's piece fills) — its stage-2 sending tensors."""

    stages: tuple[Plan, ...]
    relay_sources: dict[int, list[tuple[str, str, Box]]]

    @property
    def relayed(self) -> bool:
        return len(self.stages) > 1

    def for_rank(self, rank: int) -> list[list[Transfer]]:
        """This rank's part of each stage."""
        return [stage.for_rank(rank) for stage in self.stages]

    def predicted_seconds(self, bw: Bandwidths) -> float:
        return sum(predicted_seconds(stage, bw) for stage in self.stages)

    def bytes_received(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for stage in self.stages:
            for rank, n in stage.bytes_received().items():
                out[rank] += n
        return dict(out)


def _restricted(need: Need, piece: Box) -> Need:
    """``need`` for the part ``piece`` of its region only (its destination cut alike)."""
    return Need(need.rank, need.dest, translate(piece, need.box, need.dest_box), need.param, piece)


def seeded(needs: list[Need], itemsize: dict[str, int]) -> tuple[list[Need], list[Need]]:
    """The needs split into the seeds' (one per piece of each distinct parameter region) and the
    others'. A region larger than an equal share of the pool (the distinct bytes ÷ the ranks that
    need any) is cut into that many pieces, each seeded by another rank of its group: one embedding
    seeded whole would make its seed upload it to every other replica, the bottleneck of stage 2.
    None of a rank's needs may ask for two regions of one parameter (the seed's sending tensor is one
    per parameter); a ValueError says which."""
    groups: dict[tuple[str, Box], list[Need]] = defaultdict(list)
    for need in needs:
        groups[(need.param, need.box)].append(need)
    asked: dict[tuple[int, str], Box] = {}
    for need in needs:
        if asked.setdefault((need.rank, need.param), need.box) != need.box:
            raise ValueError(f"rank {need.rank} needs two regions of {need.param!r}: no relay")
    share = sum(volume(box) * itemsize[param] for param, box in groups) / max(len({n.rank for n in needs}), 1)
    seeded_bytes: dict[int, int] = defaultdict(int)
    seeds, others = [], []
    for (param, box), group in sorted(groups.items(), key=lambda g: (-volume(g[0][1]) * itemsize[g[0][0]], g[0])):
        pieces = split_evenly(box, min(len(group), max(1, math.ceil(volume(box) * itemsize[param] / share))))
        chosen = sorted(group, key=lambda n: (seeded_bytes[n.rank], n.rank))[:len(pieces)]
        for piece, seed in zip(pieces, chosen, strict=True):
            seeded_bytes[seed.rank] += volume(piece) * itemsize[param]
            seeds.append(_restricted(seed, piece))
            others += [_restricted(n, piece) for n in group if n is not seed]
    return seeds, others


def relayed_plan(holdings: list[Holding], needs: list[Need], ranks: dict[int, RankTopology],
                 itemsize: dict[str, int], bandwidths: Bandwidths | None = None) -> StagedPlan:
    """The two-stage schedule (module docstring)."""
    seeds, others = seeded(needs, itemsize)
    first = plan(holdings, seeds, ranks, itemsize, bandwidths)
    relays = [Holding(n.rank, n.param, n.box) for n in seeds]
    second = plan(relays, others, ranks, itemsize, bandwidths)
    sources: dict[int, list[tuple[str, str, Box]]] = defaultdict(list)
    for n in seeds:
        sources[n.rank].append((n.param, n.dest, n.dest_box))
    return StagedPlan((first, second), dict(sources))


def relay_pays(relayed_seconds: float, direct_seconds: float) -> bool:
    """Relay only where it is predicted at least :data:`RELAY_GAIN` faster: a second stage couples the
    replicas (a seed's delay is its peers'), which a gain within the cost model's error does not buy."""
    return relayed_seconds <= (1 - RELAY_GAIN) * direct_seconds


def staged_plan(holdings: list[Holding], needs: list[Need], ranks: dict[int, RankTopology],
                itemsize: dict[str, int], bandwidths: Bandwidths | None = None) -> StagedPlan:
    """The relayed schedule where it pays (:func:`relay_pays`), else the direct one."""
    bw = bandwidths or Bandwidths.uniform()
    direct = StagedPlan((plan(holdings, needs, ranks, itemsize, bw),), {})
    try:
        relayed = relayed_plan(holdings, needs, ranks, itemsize, bw)
    except ValueError:
        return direct
    return relayed if relay_pays(relayed.predicted_seconds(bw), direct.predicted_seconds(bw)) else direct
