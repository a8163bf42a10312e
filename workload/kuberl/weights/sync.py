"""The exchange modes behind ``spec.weightSync.mode`` (the package docstring has the contract):
``make_weight_sync`` picks ``p2p``, ``broadcast`` or ``disk``; ``to_safetensors`` is the whole-state wire format."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save as save_safetensors

from ..api.progress import PoolReceipt, PushMode, WeightPush
from ..api.spec import WeightSyncMode
from ..settings import Settings
from .p2p import P2PSync, ReplicaControl, WeightSource


def update_bytes(source: WeightSource) -> int:
    """What one update carries to each replica: Σ numel × the wire dtype's size over ``source``'s
    parameters (an adapter's, or the whole policy's; tied weights once)."""
    from ..devices import WIRE_DTYPE

    return sum(p.numel() for p in source.named_parameters().values()) * WIRE_DTYPE.itemsize


def to_safetensors(state: dict[str, torch.Tensor]) -> bytes:
    """The wire format of a whole-state update (tied tensors are written once per name)."""
    return save_safetensors({k: v.detach().contiguous().clone() for k, v in state.items()})


class Publisher(Protocol):
    def update_weights(self, payload: bytes | str, version: int) -> Future[PoolReceipt]:
        """Start: every replica loads ``payload`` (safetensors bytes, or a file path) as ``version``;
        the future holds the pool's receipt (each replica's seconds, those that left)."""
        ...


class WeightSync(Protocol):
    def push(self, source: WeightSource, version: int) -> None: ...

    def wait(self) -> float:
        """Until the last exchange is done; its seconds (0 when none was under way)."""
        ...

    def take_push(self) -> WeightPush | None:
        """Rank 0: the account of the last exchange waited for since the last call (None if none, and on the
        other ranks)."""
        ...

    def recover(self, source: WeightSource, version: int) -> None:
        """Every rank: the pool lost its weights (all replicas restarted); send ``version`` again in a
        way any replica can take."""
        ...


class BroadcastSync:
    """Rank 0 serialises the full state and pushes it to every replica (pause → load → resume)."""

    mode: PushMode = "broadcast"

    def __init__(self, publisher: Publisher | None):
        self.publisher = publisher
        self._pending: Future[PoolReceipt] | None = None
        self._sent: tuple[int, int, str | None] = (0, 0, None)  # the pending push's version, bytes, fallback reason
        self._done: WeightPush | None = None

    def push(self, source: WeightSource, version: int, fallback_reason: str | None = None) -> None:
        """Send ``version``; ``fallback_reason``: why it goes this way instead of p2p (its account says so)."""
        state = source.full_state_dict()  # a collective: every rank takes part, rank 0 gets it
        if self.publisher is None:  # not rank 0: nothing to send
            return
        self.wait()
        payload = self.payload(state, version)
        nbytes = len(payload) if isinstance(payload, bytes) else Path(payload).stat().st_size
        self._sent = (version, nbytes, fallback_reason)
        self._pending = self.publisher.update_weights(payload, version)

    def payload(self, state: dict[str, torch.Tensor], version: int) -> bytes | str:
        return to_safetensors(state)  # a copy: the next optimizer step may run during the transfer

    def wait(self) -> float:
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        version, nbytes, reason = self._sent
        receipt = pending.result()
        self._done = WeightPush.of(version, self.mode, nbytes, receipt, reason)
        return receipt.seconds

    def take_push(self) -> WeightPush | None:
        done, self._done = self._done, None
        return done

    def recover(self, source: WeightSource, version: int) -> None:
        self.wait()
        self.push(source, version)
        self.wait()


class DiskSync(BroadcastSync):
    """Broadcast through a shared directory: ``weights-v<version>.safetensors``, written then renamed
    (a replica never reads half a file); the two newest are kept (one may still be being read)."""

    mode: PushMode = "disk"

    def __init__(self, publisher: Publisher | None, directory: Path):
        super().__init__(publisher)
        self.directory = directory

    def payload(self, state: dict[str, torch.Tensor], version: int) -> bytes | str:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"weights-v{version:08d}.safetensors"
        partial = path.with_suffix(".partial")
        partial.write_bytes(to_safetensors(state))
        partial.rename(path)
        for old in sorted(self.directory.glob("weights-v*.safetensors"))[:-2]:
            old.unlink(missing_ok=True)
        return str(path)


def disk_directory(directory: str | None, settings: Settings) -> Path:
    """Disk mode's shared directory, the same for the trainer that writes and the replicas that read:
    ``settings.weights_dir`` (local mode's work dir), else ``directory`` (``spec.weightSync.directory``),
    else ``/tmp/kuberl-weights``."""
    return settings.weights_dir or Path(directory or "/tmp/kuberl-weights")


class RolloutControl(Publisher, ReplicaControl, Protocol):
    """What every weight-sync mode needs from rank 0's rollout controller."""


def make_weight_sync(mode: WeightSyncMode, controller: RolloutControl | None, settings: Settings, rank: int = 0,
                     world: int = 1, directory: str | None = None, relay: bool = False) -> WeightSync:
    """``spec.weightSync.mode``'s sync. ``controller`` is rank 0's rollout controller (None on the other
    ranks). ``directory``: ``spec.weightSync.directory`` (see ``disk_directory``); ``relay``:
    ``spec.weightSync.relay`` (p2p)."""
    broadcast = BroadcastSync(controller)
    match WeightSyncMode(mode):
        case WeightSyncMode.P2P:
            return P2PSync(controller, rank, world, broadcast, settings, relay)
        case WeightSyncMode.DISK:
            return DiskSync(controller, disk_directory(directory, settings))
        case WeightSyncMode.BROADCAST:
            return broadcast
