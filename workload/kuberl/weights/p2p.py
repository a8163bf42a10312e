"""``weightSync.mode: p2p`` in a running experiment: FSDP2 shards or Megatron's tensor-parallel pieces
go straight to the replicas.

Set-up (once, at the first push; every trainer rank takes part):

1. every rank reads its place from its pod labels (:mod:`.discovery`); the trainer ranks
   all-gather theirs, rank 0 asks each replica for its own (``GET /topology``);
2. every rank computes the same plan (pure, deterministic): what each trainer rank holds (the
   source's ``holdings``) → each replica;
3. rank 0 hands every replica its part of the plan (``POST /weights/p2p/join``) and all ranks
   open one exchange group (trainer ranks, then replica i as rank ``world + i``).

Each push: every rank snapshots its local shards (training goes on), rank 0 tells every replica
to receive ``version`` (``POST /weights/p2p/receive``: the replica receives into a staging copy,
then swaps it in between two engine steps and reports), and every rank sends its planned pieces.
``wait()`` returns the seconds of the exchange once every replica serves the version.

A replica that fails or straggles while it receives (hung: SIGSTOP, a wedged engine) leaves rotation
and the exchange goes on without it: the others serve the version (``InferenceClient.receive_p2p``).
Before each push rank 0 asks whether the members changed (one left, or one came back and answers
its health check); if so, every rank drops the group and the push re-forms it with the replicas that
are there (a new plan, a new ``generation`` of the group over the same store). If an exchange fails
on the trainer's side (a replica died mid-transfer: the group cannot be reused), the trainer ranks
agree on it (an all-reduce), log a warning and re-send that version by ``broadcast`` (a replaced
replica catches up through the pool's elastic path); the next push re-forms the group and goes on
in p2p. While a replica cannot be reached for the set-up, that version goes by broadcast
too and the set-up is tried again at the next; so does a group whose member left rotation while it
opened (a replica killed after it was asked to join never connects: :func:`await_group`).

With ``spec.weightSync.relay`` the plan may have two stages (:mod:`.relay`: each piece to one replica,
which forwards it to the others — chosen where predicted ≥ 10 % faster); the replicas then wait on
each other, so the first one to fail ends the exchange for its peers: they stay in rotation without
the version, which goes to them by broadcast. When every replica restarted before an exchange
could fail, rollout starves; the trainer then calls ``recover`` (broadcast now, p2p again next).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..api.progress import PoolReceipt, WeightPush
from ..collectives import all_gather, all_reduce, broadcast_from_rank0
from ..settings import Settings
from .discovery import from_json, own_topology, to_json
from .layouts import ParamMeta, inference_needs
from .plan import Bandwidths, Holding, Need, Plan, RankTopology, Transfer, plan
from .relay import StagedPlan, staged_plan
from .transport import forwards_to_json, open_group, param_metas, run_staged, transfer_to_json

log = logging.getLogger("kuberl.weights")
OPEN_POLL_SECONDS = 0.25  # how often the trainer ranks agree on a group being opened (await_group)


class WeightSource(Protocol):
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter, under the names of :meth:`named_parameters`."""
        ...

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, with its full (unsharded) shape."""
        ...

    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        """Which region of each parameter every trainer rank holds (every rank must call it)."""
        ...


class ReplicaControl(Protocol):
    """What rank 0 needs from the rollout controller (its HTTP client, on its event loop)."""

    def replica_topologies(self) -> list[dict[str, str]]: ...

    def join_p2p(self, bodies: list[dict[str, Any]]) -> None: ...

    def receive_p2p(self, version: int, relayed: bool = False) -> Future[PoolReceipt]: ...

    def p2p_membership_changed(self) -> bool:
        """A replica left the group's rotation or one came back since the group was formed."""
        ...


def in_background(work: Callable[[], Any]) -> Future[Any]:
    """``work()`` on a daemon thread of its own; the future holds its outcome (a thread that outlives
    its caller holds up nothing, not even the process's exit)."""
    outcome: Future[Any] = Future()

    def run() -> None:
        try:
            outcome.set_result(work())
        except BaseException as err:  # delivered through the future
            outcome.set_exception(err)

    threading.Thread(target=run, name="kuberl-p2p-open", daemon=True).start()
    return outcome


def await_group(opening: Future[Any], member_left: Callable[[], bool], poll: float = OPEN_POLL_SECONDS) -> Any:
    """Every trainer rank: the exchange group ``opening`` opens, once it is open on every rank; None on
    every rank when it failed to open on one, or ``member_left()`` (rank 0's pool client) says a
    member left rotation meanwhile — a replica killed after it was asked to join never connects, and
    the open would wait for it until its timeout (300 s, the trainer stalled). The ranks agree every
    ``poll`` seconds (an all-gather); an open given up ends in the background."""
    while True:
        wait([opening], timeout=poll, return_when=FIRST_COMPLETED)
        state = "opening" if not opening.done() else "failed" if opening.exception() is not None else "open"
        states = all_gather((state, member_left()))
        if all(s == "open" for s, _ in states):
            return opening.result()
        if any(s == "failed" or left for s, left in states):
            if state == "failed":
                log.warning("p2p weight exchange: the group did not open (%s)", opening.exception())
            return None


def _planning_inputs(metas: list[ParamMeta], trainers: list[RankTopology], replicas: list[RankTopology]
                     ) -> tuple[list[Need], dict[int, RankTopology], dict[str, int]]:
    """(every replica's needs — one rank each: the torch engine has no TP —, every rank's place, each
    parameter's item size): what the planners take beside the holdings."""
    n = len(trainers)
    needs = inference_needs(metas, [[n + i] for i in range(len(replicas))])
    return needs, dict(enumerate([*trainers, *replicas])), {m.name: m.itemsize for m in metas}


def plan_for(metas: list[ParamMeta], holdings: list[Holding], trainers: list[RankTopology],
             replicas: list[RankTopology]) -> Plan:
    """The trainer ranks' ``holdings`` → every replica, directly."""
    return plan(holdings, *_planning_inputs(metas, trainers, replicas))


def staged_plan_for(metas: list[ParamMeta], holdings: list[Holding], trainers: list[RankTopology],
                    replicas: list[RankTopology], relay: bool) -> StagedPlan:
    """:func:`plan_for` as one stage, or with ``relay`` the schedule :func:`.relay.staged_plan` picks
    (through the replicas where that is predicted at least 10 % faster)."""
    if not relay:
        return StagedPlan((plan_for(metas, holdings, trainers, replicas),), {})
    return staged_plan(holdings, *_planning_inputs(metas, trainers, replicas))


class P2PSync:
    def __init__(self, control: ReplicaControl | None, rank: int, world: int, fallback: Any, settings: Settings,
                 relay: bool = False):
        """``settings``: where the group's store listens (``exchange_address``), this pod's IP and place.
        ``relay``: ``spec.weightSync.relay`` (the planner may relay through the replicas)."""
        self.control, self.rank, self.world, self.settings = control, rank, world, settings
        self.relay = relay
        self.fallback = fallback  # a BroadcastSync over the same control: versions p2p could not carry
        self.generation = 0  # groups formed so far; a broken one is never reused
        self._pg: Any = None
        self._stages: list[list[Transfer]] = []  # this rank's part of each stage of the plan
        self._relayed = False  # the plan relays through the replicas: they depend on each other
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._pending: Future[Any] | None = None  # this rank's sends (and receives) of the last push
        self._receiving: Future[PoolReceipt] | None = None  # rank 0: the replicas taking it (InferenceClient)
        self._bytes_per_replica = 0  # what the plan sends each replica (the most any one gets)
        self._planned_port_bytes = 0  # what the plan puts on its busiest port (WeightPush.planned_port_bytes)
        self._done: WeightPush | None = None  # rank 0's account of the last exchange waited for
        self._broadcast: int | None = None  # the last version sent by broadcast (the pool client keeps it)
        self._last: tuple[WeightSource, int] | None = None

    def _replicas_of_rank0(self, schedule_for: Callable[[list[dict[str, str]]], StagedPlan]
                           ) -> list[dict[str, str]] | None:
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
                 "stages": [[transfer_to_json(t) for t in stage] for stage in schedule.for_rank(self.world + i)],
                 "forwards": forwards_to_json(schedule.relay_sources.get(self.world + i, []))}
                for i in range(len(replicas))
            ])  # fmt: skip
        except Exception as err:  # every rank must hear the outcome: broadcast below
            log.warning("p2p weight exchange: a replica is not reachable (%s); this version goes by broadcast", err)
            return None
        return replicas

    def _set_up(self, source: WeightSource) -> bool:
        """Form this generation's group; False (on every rank) when a replica could not join."""
        metas = param_metas(source.named_parameters())
        holdings = source.holdings(metas)
        trainers = all_gather(own_topology(self.settings.podinfo_labels, self.settings.node_name))

        def schedule_for(replicas: list[dict[str, str]]) -> StagedPlan:
            return staged_plan_for(metas, holdings, trainers, [from_json(t) for t in replicas], self.relay)

        replicas = broadcast_from_rank0(self._replicas_of_rank0(schedule_for) if self.rank == 0 else None)
        if replicas is None:
            self.generation += 1  # replicas that did join wait in a group that will never form
            return False
        schedule = schedule_for(replicas)
        if self.rank == 0:
            places = [to_json(t) for t in trainers] + replicas
            transfers = sum(len(stage.transfers) for stage in schedule.stages)
            log.info("p2p weight exchange (group %d): %d trainer ranks → %d replicas%s, %d transfers, %.1f MB per "
                     "replica; topology %s", self.generation, self.world, len(replicas),
                     " relayed through the replicas" if schedule.relayed else "", transfers,
                     max(schedule.bytes_received().values()) / 1e6, places)  # fmt: skip
        host, port, generation = *self.settings.exchange_address, self.generation
        opening = in_background(lambda: open_group(host, port, self.rank, self.world + len(replicas),
                                                   generation=generation, bind_host=self.settings.bind_host))
        self._pg = await_group(opening, lambda: self.control is not None and self.control.p2p_membership_changed())
        if self._pg is None:
            if self.rank == 0:
                log.warning("p2p weight exchange: group %d did not form (a member left while it opened); this "
                            "version goes by broadcast", generation)
            self.generation += 1
            return False
        self._stages, self._relayed = schedule.for_rank(self.rank), schedule.relayed
        self._bytes_per_replica = max(schedule.bytes_received().values(), default=0)
        self._planned_port_bytes = round(schedule.predicted_seconds(Bandwidths.uniform()))  # at 1 byte/s: bytes
        return True

    def push(self, source: WeightSource, version: int) -> None:
        self.wait()
        self._last = (source, version)
        if self._pg is not None and self._membership_changed():
            log.info("p2p weight exchange: the replicas changed; group %d is re-formed", self.generation + 1)
            self._retire_group()
        if self._pg is None and not self._set_up(source):
            self._push_by_broadcast(source, version, "the p2p group could not be formed (a replica was unreachable, "
                                                     "or left while it opened)")
            return
        # a host copy: the exchange group is gloo (TCP across pods), whatever device trains
        snapshot = {name: t.to("cpu", copy=True) for name, t in source.local_parameters().items()}
        self._receiving = self.control.receive_p2p(version, self._relayed) if self.control else None
        self._pending = self._executor.submit(run_staged, self._pg, self._stages, self.rank, snapshot, {})

    def _membership_changed(self) -> bool:
        """Every rank: rank 0's pool client says a member left rotation or a replica came back."""
        return bool(broadcast_from_rank0(self.control.p2p_membership_changed() if self.control else False))

    def _replicas_outcome(self, receiving: Future[PoolReceipt] | None) -> tuple[PoolReceipt | None, bool]:
        """Every rank: rank 0's view of the last exchange — the pool's receipt (each member that took it and
        its seconds; None: no replica did), and whether a member left on the way."""
        outcome: tuple[PoolReceipt | None, bool] = (None, True)
        if receiving is not None and self.control is not None:
            try:
                outcome = (receiving.result(), self.control.p2p_membership_changed())
            except Exception as err:  # every rank must hear it: broadcast below
                log.warning("p2p weight exchange: no replica took the version (%s)", err)
        return broadcast_from_rank0(outcome)

    def wait(self) -> float:
        """Until the last exchange is done. A member that left on the way (``_replicas_outcome``) will
        never take this rank's sends: they are abandoned with the group, re-formed at the next push.
        Otherwise the ranks agree whether each one's sends went through; if not, or if no replica
        took the version, it goes by broadcast."""
        seconds = self._wait_for_broadcast()
        pending, receiving, self._pending, self._receiving = self._pending, self._receiving, None, None
        if pending is None:
            return seconds
        receipt, member_left = self._replicas_outcome(receiving)
        if member_left:
            self._abandon(pending)
            if receipt is not None:
                return seconds + self._account(receipt)
            error: BaseException | None = None
        else:
            try:
                pending.result()
                error = None
            except Exception as err:  # every rank must reach the agreement below, whatever went wrong
                error = err
            if not all_reduce(1.0 if error else 0.0, dist.ReduceOp.MAX):
                return seconds + (self._account(receipt) if receipt is not None else 0.0)
        reason = f"p2p weight exchange failed ({error or 'on another rank or replica'})"
        log.warning("%s", reason)
        assert self._last is not None
        self._fall_back(*self._last, reason)
        return seconds + self._wait_for_broadcast()

    def _wait_for_broadcast(self) -> float:
        """Until a version sent by broadcast is done (its account becomes the last one); its seconds."""
        seconds = self.fallback.wait()
        self._done = self.fallback.take_push() or self._done
        return seconds

    def _account(self, receipt: PoolReceipt) -> float:
        """Rank 0's account of the p2p exchange of the last version from the pool's ``receipt``; its seconds (every
        rank: the slowest replica's)."""
        assert self._last is not None
        if self.rank == 0:
            self._done = WeightPush.of(self._last[1], "p2p-relayed" if self._relayed else "p2p",
                                       self._bytes_per_replica, receipt, planned_port_bytes=self._planned_port_bytes)
        return receipt.seconds

    def take_push(self) -> WeightPush | None:
        done, self._done = self._done, None
        return done

    def _abandon(self, pending: Future[Any]) -> None:
        """Leave this rank's sends to a departed member behind (they end at the group's timeout) and
        the group with them; the next push forms a new one."""
        pending.add_done_callback(lambda f: log.info("an abandoned p2p exchange ended: %s", f.exception() or "done"))
        self._executor.shutdown(wait=False)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._retire_group()

    def _retire_group(self) -> None:
        """Never use this group again: a group with a departed or dead member cannot be reused."""
        self._pg = None
        self.generation += 1

    def recover(self, source: WeightSource, version: int) -> None:
        """The pool lost its weights (every replica restarted, hung or failed, and left the group):
        broadcast this version now, unless it already went by broadcast (its exchange failed in
        ``wait``, or the group could not be formed for it: the pool client keeps it for the replicas
        that come back); the next push re-forms the group."""
        self.wait()
        if self._broadcast == version:
            return  # the pool client holds it and hands it to each replica that comes back
        self._fall_back(source, version, "no replica had the weights (the pool restarted or lost them)")
        self._wait_for_broadcast()

    def _fall_back(self, source: WeightSource, version: int, reason: str) -> None:
        log.warning("version %d goes by broadcast; the p2p group is re-formed at the next push", version)
        self._retire_group()
        self._push_by_broadcast(source, version, reason)

    def _push_by_broadcast(self, source: WeightSource, version: int, reason: str) -> None:
        """``version`` the whole-state way (``reason``: why not p2p); the pool client keeps it for replicas that
        come back (``recover``)."""
        self.fallback.push(source, version, reason)
        self._broadcast = version
