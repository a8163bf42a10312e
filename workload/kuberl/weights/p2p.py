"""``weightSync.mode: p2p`` in a running experiment: FSDP2 shards go straight to the replicas.

Set-up (once, at the first push; every trainer rank takes part):

1. every rank reads its place from its pod labels (:mod:`.discovery`); the trainer ranks
   all-gather theirs, rank 0 asks each replica for its own (``GET /topology``);
2. every rank computes the same plan (pure, deterministic): the FSDP2 shards → each replica;
3. rank 0 hands every replica its part of the plan (``POST /weights/p2p/join``) and all ranks
   open one exchange group (trainer ranks, then replica i as rank ``world + i``).

Each push: every rank snapshots its local shards (training goes on), rank 0 tells every replica
to receive ``version`` (``POST /weights/p2p/receive``: the replica receives into a staging copy,
then swaps it in between two engine steps and reports), and every rank sends its planned pieces.
``wait()`` returns the seconds of the exchange once every replica serves the version.

If an exchange fails (a replica died or restarted: the group cannot be reused), the trainer ranks
agree on it (an all-reduce), log a warning and re-send that version by ``broadcast`` (a replaced
replica catches up through the pool's elastic path); the next push re-forms the group with the
replicas that are there (a new plan, a new ``generation`` of the group over the same store) and
goes on in p2p. While a replica cannot be reached for the set-up, that version goes by broadcast
too and the set-up is tried again at the next. When every replica restarted before an exchange
could fail, rollout starves; the trainer then calls ``recover`` (broadcast now, p2p again next).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..collectives import all_gather, all_reduce, broadcast_from_rank0
from ..settings import Settings
from .discovery import from_json, own_topology, to_json
from .layouts import fsdp2_holdings, inference_needs
from .plan import Plan, RankTopology, Transfer, plan
from .transport import open_group, param_metas, run_exchange, transfer_to_json

log = logging.getLogger("kuberl.weights")


class WeightSource(Protocol):
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def local_parameters(self) -> dict[str, torch.Tensor]: ...

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, with its full (unsharded) shape."""
        ...


class ReplicaControl(Protocol):
    """What rank 0 needs from the rollout controller (its HTTP client, on its event loop)."""

    def replica_topologies(self) -> list[dict[str, str]]: ...

    def join_p2p(self, bodies: list[dict[str, Any]]) -> None: ...

    def receive_p2p(self, version: int) -> Future[float]: ...


def plan_for(metas: Any, trainers: list[RankTopology], replicas: list[RankTopology]) -> Plan:
    """FSDP2 shards over the trainer ranks → every replica (one rank each: the torch engine has no TP)."""
    n = len(trainers)
    topology = dict(enumerate([*trainers, *replicas]))
    needs = inference_needs(metas, [[n + i] for i in range(len(replicas))])
    return plan(fsdp2_holdings(metas, list(range(n))), needs, topology, {m.name: m.itemsize for m in metas})


class P2PSync:
    def __init__(self, control: ReplicaControl | None, rank: int, world: int, fallback: Any, settings: Settings):
        """``settings``: where the group's store listens (``exchange_address``), this pod's IP and place."""
        self.control, self.rank, self.world, self.settings = control, rank, world, settings
        self.fallback = fallback  # a BroadcastSync over the same control: versions p2p could not carry
        self.generation = 0  # groups formed so far; a broken one is never reused
        self._pg: Any = None
        self._mine: list[Transfer] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._pending: Future[float] | None = None
        self._last: tuple[WeightSource, int] | None = None

    def _replicas_of_rank0(self, schedule_for: Callable[[list[dict[str, str]]], Plan]) -> list[dict[str, str]] | None:
        """Rank 0: every replica's topology, each joined to this generation's group; None when a
        replica cannot be reached (then nobody opens the group)."""
        if self.control is None:
            return None
        try:
            replicas = self.control.replica_topologies()
            schedule = schedule_for(replicas)
            world = self.world + len(replicas)
            self.control.join_p2p([
                {"rank": self.world + i, "world": world, "generation": self.generation,
                 "transfers": [transfer_to_json(t) for t in schedule.for_rank(self.world + i)]}
                for i in range(len(replicas))
            ])  # fmt: skip
        except Exception as err:  # every rank must hear the outcome: broadcast below
            log.warning("p2p weight exchange: a replica is not reachable (%s); this version goes by broadcast", err)
            return None
        return replicas

    def _set_up(self, source: WeightSource) -> bool:
        """Form this generation's group; False (on every rank) when a replica could not join."""
        metas = param_metas(source.named_parameters())
        trainers = all_gather(own_topology(self.settings.podinfo_labels, self.settings.node_name))

        def schedule_for(replicas: list[dict[str, str]]) -> Plan:
            return plan_for(metas, trainers, [from_json(t) for t in replicas])

        replicas = broadcast_from_rank0(self._replicas_of_rank0(schedule_for) if self.rank == 0 else None)
        if replicas is None:
            self.generation += 1  # replicas that did join wait in a group that will never form
            return False
        schedule = schedule_for(replicas)
        if self.rank == 0:
            places = [to_json(t) for t in trainers] + replicas
            log.info("p2p weight exchange (group %d): %d trainer ranks → %d replicas, %d transfers, %.1f MB per "
                     "replica; topology %s", self.generation, self.world, len(replicas), len(schedule.transfers),
                     max(schedule.bytes_received().values()) / 1e6, places)  # fmt: skip
        host, port = self.settings.exchange_address
        self._pg = open_group(host, port, self.rank, self.world + len(replicas), generation=self.generation,
                              bind_host=self.settings.bind_host)
        self._mine = schedule.for_rank(self.rank)
        return True

    def push(self, source: WeightSource, version: int) -> None:
        self.wait()
        self._last = (source, version)
        if self._pg is None and not self._set_up(source):
            self.fallback.push(source, version)
            return
        # a host copy: the exchange group is gloo (TCP across pods), whatever device trains
        snapshot = {name: t.to("cpu", copy=True) for name, t in source.local_parameters().items()}
        self._pending = self._executor.submit(self._exchange, snapshot, version)

    def _exchange(self, snapshot: dict[str, torch.Tensor], version: int) -> float:
        receiving = self.control.receive_p2p(version) if self.control else None
        stats = run_exchange(self._pg, self._mine, self.rank, snapshot, {})
        return receiving.result() if receiving is not None else stats.seconds

    def wait(self) -> float:
        seconds = self.fallback.wait()
        pending, self._pending = self._pending, None
        if pending is None:
            return seconds
        error: BaseException | None = None
        try:
            seconds += pending.result()
        except Exception as err:  # every rank must reach the agreement below, whatever went wrong
            error = err
        if not all_reduce(1.0 if error else 0.0, dist.ReduceOp.MAX):
            return seconds
        log.warning("p2p weight exchange failed (%s)", error or "on another trainer rank")
        assert self._last is not None
        self._fall_back(*self._last)
        return seconds + self.fallback.wait()

    def recover(self, source: WeightSource, version: int) -> None:
        """The pool lost its weights (every replica restarted and left the group): broadcast this
        version now, unless it just went by broadcast (its exchange failed in ``wait``, or the group
        could not be formed for it); the next push re-forms the group."""
        self.wait()
        if self._pg is None and self._last is not None and self._last[1] == version:
            return  # the pool client holds it and hands it to each replica that comes back
        self._fall_back(source, version)
        self.fallback.wait()

    def _fall_back(self, source: WeightSource, version: int) -> None:
        log.warning("version %d goes by broadcast; the p2p group is re-formed at the next push", version)
        self._pg = None  # a group with a dead member cannot be reused
        self.generation += 1
        self.fallback.push(source, version)
