"""Training states (the SDK's ``save_state`` / ``load_state``): a model's trained weights, its optimizer's state
and what it is (base model, adapter shape), kept in a checkpoint store (``file://`` or ``s3://``, as
``spec.checkpoint.uri``) so that a client resumes after its session, or the server, ends.

``tinker://MODEL/weights/NAME`` is kept under ``<uri>tinker/<client>/<MODEL>/<NAME>/``: ``state.pt`` (the
tensors, read back with ``torch.load(weights_only=True)``: no code in a state runs) and ``meta.json``. The
client is part of the key, so a client reads only states it saved: another's path is "no such state".
The SDK's ``RestClient.list_checkpoints`` / ``delete_checkpoint`` / ``set_checkpoint_ttl_from_tinker_path``
list, delete and re-time a client's states of one model. A state saved with ``ttl_seconds`` expires then: it
is no longer listed or loaded, and its files are deleted the next time it is looked at.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.store import CheckpointError, Store
from .errors import ClientError, NotFound
from .trainee import AdapterShape

SCHEME = "tinker://"
NAME_PATTERN, MODEL_PATTERN = r"[A-Za-z0-9._-]{1,128}", r"[A-Za-z0-9:._-]{1,200}"  # a state's name; a model id
NAME, MODEL = re.compile(rf"^{NAME_PATTERN}$"), re.compile(rf"^{MODEL_PATTERN}$")
PATH = re.compile(rf"^{SCHEME}(?P<model>{MODEL_PATTERN})/weights/(?P<name>{NAME_PATTERN})$")
STATE, META = "state.pt", "meta.json"


@dataclass
class TrainingState:
    base_model: str
    adapter: AdapterShape | None
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    steps: int


@dataclass(frozen=True)
class Keeping:
    """How a saved state is kept: until ``expires_at`` (seconds since the epoch; None: until deleted), with the
    client's own ``user_metadata``."""

    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None

    @classmethod
    def from_ttl(cls, ttl_seconds: int | None, user_metadata: dict[str, str] | None = None) -> Keeping:
        return cls(None if ttl_seconds is None else time.time() + ttl_seconds, user_metadata)

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and time.time() >= self.expires_at


UNTIL_DELETED = Keeping()


@dataclass(frozen=True)
class SavedState:
    """A state as listed: its ``tinker://`` path, when it was saved (seconds since the epoch) and its tensors' bytes."""

    path: str
    saved_at: float
    size_bytes: int
    keeping: Keeping = UNTIL_DELETED


def state_path(model_id: str, name: str) -> str:
    if not NAME.match(name) or name in (".", ".."):
        raise ClientError(f"path {name!r}: a state's name is 1–128 letters, digits, '.', '_' or '-' (not . or ..)")
    return f"{SCHEME}{model_id}/weights/{name}"


def _key(owner: str, path: str) -> str:
    match = PATH.match(path)
    if match is None or {match["model"], match["name"]} & {".", ".."}:
        raise ClientError(f"path {path!r}: a state is {SCHEME}MODEL/weights/NAME (save_state returns it)")
    return f"{_model_key(owner, match['model'])}{match['name']}/"


def _model_key(owner: str, model_id: str) -> str:
    if not MODEL.match(model_id) or model_id in (".", ".."):
        raise ClientError(f"model {model_id!r}: not a model id (create_model returns one)")
    return f"tinker/{owner}/{model_id}/"


class StateStore:
    def __init__(self, store: Store):
        self.store = store

    def save(self, owner: str, path: str, state: TrainingState, overwrite: bool,
             keeping: Keeping = UNTIL_DELETED) -> None:
        key = _key(owner, path)
        if not overwrite and self._meta(owner, path) is not None:
            raise ClientError(f"path {path!r} exists; save under another name or with overwrite=True")
        meta = {"base_model": state.base_model, "steps": state.steps, "saved_at": time.time(),
                "adapter": dataclasses.asdict(state.adapter) if state.adapter else None,
                "expires_at": keeping.expires_at, "user_metadata": keeping.user_metadata}
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / STATE
            torch.save({"weights": state.weights, "optimizer": state.optimizer}, local)
            self.store.upload(local, key + STATE)
        self.store.write_text(key + META, json.dumps(meta))  # last: a state with its meta is complete

    def _meta(self, owner: str, path: str) -> dict[str, Any] | None:
        """A state's meta, None when there is none — or it has expired (then the state is deleted)."""
        key = _key(owner, path)
        text = self.store.read_text(key + META)
        meta = json.loads(text) if text is not None else None
        if meta is not None and _keeping(meta).expired:
            self.store.delete_prefix(key)
            return None
        return meta

    def _existing_meta(self, owner: str, path: str) -> dict[str, Any]:
        meta = self._meta(owner, path)
        if meta is None:
            raise NotFound(f"path {path!r}: no such state of yours (or it expired)")
        return meta

    def describe(self, owner: str, path: str) -> tuple[str, AdapterShape | None]:
        """A state's base model and adapter shape (None: full-parameter), from its meta alone."""
        meta = self._existing_meta(owner, path)
        return meta["base_model"], _adapter(meta)

    def load(self, owner: str, path: str) -> TrainingState:
        key = _key(owner, path)
        meta = self._meta(owner, path)
        if meta is None:
            raise ClientError(f"path {path!r}: no such state of yours (or it expired)")
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / STATE
            try:
                self.store.download(key + STATE, local)
            except CheckpointError as err:
                raise ClientError(f"path {path!r}: its tensors cannot be read ({err})") from err
            tensors = torch.load(local, weights_only=True)
        return TrainingState(meta["base_model"], _adapter(meta), tensors["weights"], tensors["optimizer"],
                             meta["steps"])

    def saved(self, owner: str, model_id: str) -> list[SavedState]:
        """``owner``'s states of ``model_id``, oldest first (each complete: its meta is written last)."""
        prefix = _model_key(owner, model_id)
        sizes = self.store.list(prefix)
        found = []
        for key in sizes:
            name = key.removeprefix(prefix).removesuffix("/" + META)
            path = f"{SCHEME}{model_id}/weights/{name}"
            meta = self._meta(owner, path) if key.endswith("/" + META) and NAME.match(name) else None
            if meta is not None:
                found.append(SavedState(path, float(meta.get("saved_at", 0.0)), sizes.get(f"{prefix}{name}/{STATE}", 0),
                                        _keeping(meta)))
        return sorted(found, key=lambda state: (state.saved_at, state.path))

    def delete(self, owner: str, path: str) -> None:
        self._existing_meta(owner, path)
        self.store.delete_prefix(_key(owner, path))

    def set_ttl(self, owner: str, path: str, ttl_seconds: int | None) -> None:
        """Keep the state ``ttl_seconds`` from now (None: until deleted)."""
        meta = self._existing_meta(owner, path)
        meta["expires_at"] = Keeping.from_ttl(ttl_seconds).expires_at
        self.store.write_text(_key(owner, path) + META, json.dumps(meta))


def _keeping(meta: dict[str, Any]) -> Keeping:
    return Keeping(meta.get("expires_at"), meta.get("user_metadata"))


def _adapter(meta: dict[str, Any]) -> AdapterShape | None:
    return AdapterShape(**meta["adapter"]) if meta["adapter"] else None
