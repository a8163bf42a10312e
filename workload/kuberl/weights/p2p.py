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
agree on it (an all-reduce), log a warning, and run the rest of the experiment in ``broadcast``
mode, starting by re-sending the failed version; replicas that come back then catch up through
the pool's elastic path. When every replica restarted before an exchange could fail, rollout
starves; the trainer then calls ``recover`` (same fall-back). Re-forming the p2p group with a
replaced replica is future work.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..api.contract import ENV_EXCHANGE_ADDR, ENV_EXCHANGE_PORT
from ..collectives import all_gather, all_reduce, broadcast_from_rank0
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


def exchange_address() -> tuple[str, int]:
    """Where the exchange group's store listens: trainer rank 0 (``MASTER_ADDR``; on inference pods
    ``KUBERL_EXCHANGE_ADDR``, which the operator sets to rank 0's DNS name), ``MASTER_PORT`` + 1."""
    host = os.environ.get(ENV_EXCHANGE_ADDR) or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = int(os.environ.get(ENV_EXCHANGE_PORT) or int(os.environ.get("MASTER_PORT", "29500")) + 1)
    return host, port


def plan_for(metas: Any, trainers: list[RankTopology], replicas: list[RankTopology]) -> Plan:
    """FSDP2 shards over the trainer ranks → every replica (one rank each: the torch engine has no TP)."""
    n = len(trainers)
    topology = dict(enumerate([*trainers, *replicas]))
    needs = inference_needs(metas, [[n + i] for i in range(len(replicas))])
    return plan(fsdp2_holdings(metas, list(range(n))), needs, topology, {m.name: m.itemsize for m in metas})


class P2PSync:
    def __init__(self, control: ReplicaControl | None, rank: int, world: int, fallback: Any):
        self.control, self.rank, self.world = control, rank, world
        self.fallback = fallback  # a BroadcastSync over the same control, used once p2p failed
        self.failed = False
        self._pg: Any = None
        self._mine: list[Transfer] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._pending: Future[float] | None = None
        self._last: tuple[WeightSource, int] | None = None

    def _set_up(self, source: WeightSource) -> None:
        metas = param_metas(source.named_parameters())
        trainers = all_gather(own_topology())
        replicas = broadcast_from_rank0(self.control.replica_topologies() if self.control else None)
        replica_topology = [from_json(t) for t in replicas]
        schedule = plan_for(metas, trainers, replica_topology)
        host, port = exchange_address()
        world = self.world + len(replica_topology)
        if self.control is not None:
            self.control.join_p2p([
                {"rank": self.world + i, "world": world,
                 "transfers": [transfer_to_json(t) for t in schedule.for_rank(self.world + i)]}
                for i in range(len(replica_topology))
            ])  # fmt: skip
            places = [to_json(t) for t in trainers + replica_topology]
            log.info("p2p weight exchange: %d trainer ranks → %d replicas, %d transfers, %.1f MB per replica; "
                     "topology %s", self.world, len(replica_topology), len(schedule.transfers),
                     max(schedule.bytes_received().values()) / 1e6, places)  # fmt: skip
        self._pg = open_group(host, port, self.rank, world, bind_host=os.environ.get("POD_IP", ""))
        self._mine = schedule.for_rank(self.rank)

    def push(self, source: WeightSource, version: int) -> None:
        if self.failed:
            return self.fallback.push(source, version)
        self.wait()
        if self._pg is None:
            self._set_up(source)
        # a host copy: the exchange group is gloo (TCP across pods), whatever device trains
        snapshot = {name: t.to("cpu", copy=True) for name, t in source.local_parameters().items()}
        self._last = (source, version)
        self._pending = self._executor.submit(self._exchange, snapshot, version)

    def _exchange(self, snapshot: dict[str, torch.Tensor], version: int) -> float:
        receiving = self.control.receive_p2p(version) if self.control else None
        stats = run_exchange(self._pg, self._mine, self.rank, snapshot, {})
        return receiving.result() if receiving is not None else stats.seconds

    def wait(self) -> float:
        if self.failed:
            return self.fallback.wait()
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        error: BaseException | None = None
        try:
            seconds = pending.result()
        except Exception as err:  # every rank must reach the agreement below, whatever went wrong
            error, seconds = err, 0.0
        if not all_reduce(1.0 if error else 0.0, dist.ReduceOp.MAX):
            return seconds
        log.warning("p2p weight exchange failed (%s)", error or "on another trainer rank")
        assert self._last is not None
        source, version = self._last
        self._fall_back(source, version)
        return self.fallback.wait()

    def recover(self, source: WeightSource, version: int) -> None:
        """The pool lost its weights (every replica restarted and left the group): broadcast from now on."""
        self.wait()
        if self.failed:
            self.fallback.recover(source, version)
        else:
            self._fall_back(source, version)
            self.fallback.wait()

    def _fall_back(self, source: WeightSource, version: int) -> None:
        log.warning("continuing in broadcast mode from version %d", version)
        self.failed = True
        self._pg = None  # a group with a dead member cannot be reused
        self.fallback.push(source, version)
