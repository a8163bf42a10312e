"""A model's checkpoints as the SDK's ``RestClient`` sees them: training states (``tinker://MODEL/weights/NAME``,
in the checkpoint store: :mod:`.states`) and named sampler weights (``tinker://MODEL/sampler_weights/NAME``, kept
in memory while their model lives: :class:`NamedWeights`), each with how long it is kept (:class:`.states.Keeping`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from dataclasses import dataclass

import torch

from .errors import ClientError, NotFound
from .states import SCHEME, Keeping, SavedState

WEIGHTS, SAMPLER_WEIGHTS = "weights", "sampler_weights"
_PATH = re.compile(rf"^{SCHEME}(?P<model>[^/]+)/(?P<kind>{WEIGHTS}|{SAMPLER_WEIGHTS})/[^/]+$")


def parse(path: str, field: str = "tinker_path") -> tuple[str, str]:
    """(model id, ``weights`` or ``sampler_weights``) of a checkpoint's path; ClientError naming ``field``."""
    match = _PATH.match(path)
    if match is None:
        raise ClientError(f"{field} {path!r}: {SCHEME}MODEL/{WEIGHTS}/NAME or {SCHEME}MODEL/{SAMPLER_WEIGHTS}/NAME")
    return match["model"], match["kind"]


@dataclass(frozen=True)
class Snapshot:
    """Weights saved for sampling under a name; ``saved_at``: seconds since the epoch."""

    weights: dict[str, torch.Tensor]
    saved_at: float
    keeping: Keeping

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())


@dataclass(frozen=True)
class Checkpoint:
    """One entry of ``list_checkpoints``: ``kind`` training (a state) or sampler (named weights)."""

    kind: str
    path: str
    saved_at: float
    size_bytes: int
    keeping: Keeping

    @property
    def checkpoint_id(self) -> str:
        return self.path.removeprefix(SCHEME).split("/", 1)[1]


class NamedWeights:
    """One model's named sampler weights, the newest ``limit``; those past their TTL are gone when next looked at."""

    def __init__(self, limit: int):
        self.limit = limit
        self._saved: collections.OrderedDict[str, Snapshot] = collections.OrderedDict()

    def keep(self, path: str, snapshot: Snapshot) -> None:
        self._saved[path] = snapshot
        self._saved.move_to_end(path)
        while len(self._saved) > self.limit:
            self._saved.popitem(last=False)

    def live(self) -> collections.OrderedDict[str, Snapshot]:
        for path in [p for p, snap in self._saved.items() if snap.keeping.expired]:
            del self._saved[path]
        return self._saved

    def get(self, path: str) -> Snapshot:
        snapshot = self.live().get(path)
        if snapshot is None:
            raise NotFound(f"{path!r}: no such saved weights of yours (save_weights_for_sampler names them; they "
                           "last while their model does, or their TTL)")
        return snapshot

    def retime(self, path: str, ttl_seconds: int | None) -> None:
        snapshot = self.get(path)
        keeping = dataclasses.replace(snapshot.keeping, expires_at=Keeping.from_ttl(ttl_seconds).expires_at)
        self._saved[path] = dataclasses.replace(snapshot, keeping=keeping)

    def delete(self, path: str) -> None:
        self.get(path)
        del self._saved[path]


def listing(states: list[SavedState], named: NamedWeights | None) -> list[Checkpoint]:
    """States first (oldest first), then the live model's named weights in the order they were saved."""
    return ([Checkpoint("training", s.path, s.saved_at, s.size_bytes, s.keeping) for s in states]
            + [Checkpoint("sampler", path, snap.saved_at, snap.size_bytes, snap.keeping)
               for path, snap in (named.live() if named is not None else {}).items()])
