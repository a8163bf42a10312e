"""Trainer checkpoints: sharded model + optimizer state (torch.distributed.checkpoint) and the
trainer's own counters, in a staging directory that ``kuberl.checkpoint.CheckpointManager``
uploads (manifest last).

Resuming restores exactly what the next step depends on: parameters, AdamW moments and step
counts, the policy version, the data position and the RNG state. Admission restarts at
version × batch (``StalenessManager.restore``), so no burst of stale samples follows a resume.
"""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..checkpoint import CheckpointManager, open_store
from .actor import Actor

STATE_FILE = "trainer_state.json"
SHARDS_DIR = "dcp"


@dataclass
class TrainerState:
    step: int
    version: int
    data_position: int
    rng: str = ""  # base64 of torch.get_rng_state()

    @classmethod
    def capture(cls, step: int, version: int, data_position: int) -> TrainerState:
        return cls(step, version, data_position, base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())

    def restore_rng(self) -> None:
        if self.rng:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(self.rng)), dtype=torch.uint8))


def save_trainer(actor: Actor, state: TrainerState, staging: Path) -> Path:
    """Every rank writes its shards under ``staging/dcp``; rank 0 also writes the trainer state."""
    model_state, optim_state = get_state_dict(actor.model, actor.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging / SHARDS_DIR))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (staging / STATE_FILE).write_text(json.dumps(asdict(state)))
    return staging


def load_trainer(actor: Actor, staging: Path) -> TrainerState:
    """Load shards and counters written by ``save_trainer`` (into an actor built the same way)."""
    model_state, optim_state = get_state_dict(actor.model, actor.optimizer)
    target = {"model": model_state, "optim": optim_state}
    dcp.load(target, checkpoint_id=str(staging / SHARDS_DIR))
    set_state_dict(actor.model, actor.optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    state = TrainerState(**json.loads((staging / STATE_FILE).read_text()))
    state.restore_rng()
    return state


class Checkpointer:
    """Every ``every`` steps: all ranks write shards into a staging directory, rank 0 uploads them
    through the manifest store. ``resume()`` finds the newest complete checkpoint, if any.

    The staging directory must be visible to every rank (one pod, or a shared volume); separate
    pods per rank would each upload their own shards, which is not built yet.
    """

    def __init__(self, uri: str | None, every: int, keep: int, staging: Path, rank: int):
        self.every, self.staging, self.rank = every, staging, rank
        self.manager = CheckpointManager(open_store(uri), keep) if uri and rank == 0 else None
        self.enabled = uri is not None

    def _broadcast(self, value: object) -> object:
        box = [value]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def resume(self, actor: Actor) -> TrainerState | None:
        where = None
        if self.manager is not None:
            latest = self.manager.latest()
            if latest is not None:
                where = str(self.manager.restore(latest, self.staging / f"restore-{latest.step}"))
        where = self._broadcast(where)
        return load_trainer(actor, Path(where)) if isinstance(where, str) else None

    def maybe_save(self, actor: Actor, step: int, version: int, data_position: int) -> str | None:
        """Checkpoint after ``step`` steps when it is due; returns the checkpoint URI on rank 0."""
        if not self.enabled or step % self.every:
            return None
        staging = self.staging / f"save-{step}"
        save_trainer(actor, TrainerState.capture(step, version, data_position), staging)
        if dist.is_initialized():
            dist.barrier()
        uri = self.manager.save(staging, step, {"version": version}) if self.manager is not None else None
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        return uri
