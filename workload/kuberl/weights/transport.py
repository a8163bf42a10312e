"""Execute a weight-exchange schedule with torch.distributed point-to-point (gloo here, NCCL/HCCL
where present).

The exchange group is its own ``ProcessGroupGloo`` over a ``TCPStore`` — trainer ranks and
inference ranks in one world, independent of the trainer's default process group — so inference
processes, which never join the training job, can be reached. Each rank runs
:func:`run_exchange` with its part of the same :class:`~kuberl.weights.plan.Plan`: transfers
between one (sender, receiver) pair are packed in order into buckets of at most ``bucket_bytes``
(a transfer larger than that travels alone), every bucket is posted at once (batched
isend/irecv; tags number a pair's buckets), and a bucket holding a single contiguous region is
sent from / received into the tensor itself without a staging copy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .layouts import ParamMeta
from .plan import Box, Transfer

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class Bucket:
    peer: int
    sending: bool
    tag: int
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass
class ExchangeStats:
    seconds: float
    bytes_sent: int
    bytes_received: int
    messages: int


def transfer_to_json(t: Transfer) -> list[object]:
    """A transfer as JSON (how rank 0 hands a replica its part of the plan)."""
    return [t.src, t.dst, t.param, t.box, t.src_box, t.dest, t.dest_box, t.nbytes]


def transfer_from_json(row: list[Any]) -> Transfer:
    src, dst, param, box, src_box, dest, dest_box, nbytes = row

    def as_box(b: list[list[int]]) -> Box:
        return tuple((int(lo), int(hi)) for lo, hi in b)

    return Transfer(int(src), int(dst), str(param), as_box(box), as_box(src_box), str(dest), as_box(dest_box),
                    int(nbytes))  # fmt: skip


def forwards_to_json(forwards: Sequence[tuple[str, str, Box]]) -> list[list[object]]:
    """What a seed forwards in a relayed stage (parameter, its destination tensor, the region the piece
    fills: :attr:`.relay.StagedPlan.relay_sources`) as JSON."""
    return [[param, dest, [list(r) for r in box]] for param, dest, box in forwards]


def forwards_from_json(rows: list[Any]) -> list[tuple[str, str, Box]]:
    return [(str(param), str(dest), tuple((int(lo), int(hi)) for lo, hi in box)) for param, dest, box in rows]


_SERVED_STORES: dict[tuple[str, int], dist.TCPStore] = {}  # rank 0's store, kept across generations


def _exchange_store(host: str, port: int, rank: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0 serves the store once per process (its port stays bound for every later group). Every
    rank, rank 0 too, opens each group over a connection of its own: a group given up while it opened
    (``kuberl.weights.p2p.await_group``) still waits on its connection until its timeout, and on a
    shared one would hold up every later group's rendezvous as long (seen: 300 s)."""
    if rank == 0 and (host, port) not in _SERVED_STORES:
        _SERVED_STORES[(host, port)] = dist.TCPStore(host, port, None, is_master=True, timeout=timeout,
                                                     wait_for_workers=False)
    return dist.TCPStore(host, port, None, is_master=False, timeout=timeout)


def open_group(
    store_host: str, store_port: int, rank: int, world: int, *, bind_host: str = "", timeout_s: float = 300.0,
    generation: int = 0,
) -> dist.ProcessGroup:
    """Join the exchange world (rank 0 hosts the store); blocks until all ``world`` ranks joined.

    ``generation`` numbers the groups formed over one store: a group re-formed after a member was
    replaced rendezvouses under its own key prefix, apart from the broken one. ``bind_host`` is the
    address this rank's gloo device listens on (the pod IP; default: what the hostname resolves
    to, or ``GLOO_SOCKET_IFNAME``).
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"kuberl-exchange-{generation}", _exchange_store(store_host, store_port, rank, timeout))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [
        dist.ProcessGroupGloo.create_device(hostname=bind_host)
        if bind_host
        else dist.ProcessGroupGloo.create_default_device()
    ]
    pg = dist.ProcessGroupGloo(store, rank, world, options)
    pg.barrier().wait()
    return pg


def buckets_for(transfers: list[Transfer], rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """This rank's buckets, in the same order and with the same tags on both ends of each pair."""
    by_pair: dict[tuple[int, bool], list[Transfer]] = defaultdict(list)
    for t in transfers:  # the plan's order: sorted by (src, dst, param, box)
        if t.src == rank:
            by_pair[(t.dst, True)].append(t)
        if t.dst == rank:
            by_pair[(t.src, False)].append(t)
    out = []
    for (peer, sending), items in sorted(by_pair.items()):
        current = Bucket(peer, sending, 0)
        for t in items:
            if current.transfers and current.nbytes + t.nbytes > bucket_bytes:
                out.append(current)
                current = Bucket(peer, sending, current.tag + 1)
            current.transfers.append(t)
        out.append(current)
    return out


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    if len(box) != tensor.dim() or any(b > n for (_, b), n in zip(box, tensor.shape, strict=True)):
        raise ValueError(f"region {box} is outside a tensor of shape {tuple(tensor.shape)}")
    return tensor[tuple(slice(a, b) for a, b in box)]


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1).view(torch.uint8)


def _checked(view: torch.Tensor, t: Transfer) -> torch.Tensor:
    if view.numel() * view.element_size() != t.nbytes:
        raise ValueError(
            f"{t.param}{t.box}: the plan moves {t.nbytes} bytes but the local tensor region is "
            f"{view.numel()} × {view.dtype} (trainer and inference dtypes must match)"
        )
    return view


def param_metas(tensors: Mapping[str, torch.Tensor]) -> list[ParamMeta]:
    """Planner metadata (name, full shape, bytes per element) of unsharded tensors."""
    return [ParamMeta(name, tuple(t.shape), t.element_size()) for name, t in tensors.items()]


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (a collective: every rank of its mesh must call it), else itself."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The slice of ``param`` this rank holds: an FSDP2 (DTensor) parameter's local shard, else itself."""
    to_local = getattr(param, "to_local", None)
    return (to_local() if to_local is not None else param).detach()


def run_exchange(
    pg: dist.ProcessGroup,
    transfers: list[Transfer],
    rank: int,
    sources: Mapping[str, torch.Tensor],
    dests: Mapping[str, torch.Tensor],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ExchangeStats:
    """Send this rank's pieces from ``sources`` (param name → local tensor holding the planned
    slice) and receive its pieces into ``dests`` (dest name → local tensor). Returns when both are done.

    ``sources`` must not change until this returns (pass a snapshot when training goes on).
    """
    start = time.perf_counter()
    works, unpack = [], []
    sent = received = 0
    for bucket in buckets_for(transfers, rank, bucket_bytes):
        if bucket.sending:
            views = [_checked(_region(sources[t.param], t.src_box), t) for t in bucket.transfers]
            if len(views) == 1 and views[0].is_contiguous():
                payload = _as_bytes(views[0])
            else:
                payload = torch.cat([_as_bytes(v.contiguous()) for v in views])
            works.append(pg.send([payload], bucket.peer, bucket.tag))
            sent += payload.numel()
            continue
        views = [_checked(_region(dests[t.dest], t.dest_box), t) for t in bucket.transfers]
        if len(views) == 1 and views[0].is_contiguous():
            works.append(pg.recv([_as_bytes(views[0])], bucket.peer, bucket.tag))
        else:
            staging = torch.empty(bucket.nbytes, dtype=torch.uint8)
            works.append(pg.recv([staging], bucket.peer, bucket.tag))
            unpack.append((staging, views))
        received += bucket.nbytes
    for work in works:
        work.wait()
    for staging, views in unpack:
        offset = 0
        for view in views:
            n = view.numel() * view.element_size()
            view.copy_(staging[offset : offset + n].view(view.dtype).view(view.shape))
            offset += n
    return ExchangeStats(time.perf_counter() - start, sent, received, len(works))


def run_staged(
    pg: dist.ProcessGroup,
    stages: list[list[Transfer]],
    rank: int,
    sources: Mapping[str, torch.Tensor],
    dests: Mapping[str, torch.Tensor],
    forwards: Sequence[tuple[str, str, Box]] = (),
) -> ExchangeStats:
    """This rank's part of a staged schedule (:mod:`kuberl.weights.relay`), stage after stage: stage 1
    from ``sources``; later stages from what this rank received, ``forwards`` naming where (parameter,
    its destination tensor, the region the piece filled). Returns the stages' totals."""
    relayed = {param: _region(dests[dest], box) for param, dest, box in forwards}
    total = ExchangeStats(0.0, 0, 0, 0)
    for index, transfers in enumerate(stages):
        stats = run_exchange(pg, transfers, rank, sources if index == 0 else relayed, dests)
        total = ExchangeStats(total.seconds + stats.seconds, total.bytes_sent + stats.bytes_sent,
                              total.bytes_received + stats.bytes_received, total.messages + stats.messages)
    return total
