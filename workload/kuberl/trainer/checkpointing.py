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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..checkpoint import CheckpointError, CheckpointManager, open_store
from ..checkpoint.layout import CRITIC_DIR, MODEL_DIR, SHARDS_DIR, STATE_FILE
from ..collectives import all_gather, barrier, broadcast_from_rank0
from ..policy.actor import Actor


@dataclass
class TrainerState:
    step: int
    version: int
    data_position: int  # dataset examples handed out (an agent run's tasks); the ledger's cursor otherwise
    rng: str = ""  # base64 of torch.get_rng_state()
    prompts: dict[str, Any] | None = None  # kuberl.rollout.ledger.PromptLedger.state() (None: older checkpoints)

    @classmethod
    def capture(cls, step: int, version: int, data_position: int,
                prompts: dict[str, Any] | None = None) -> TrainerState:
        rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        return cls(step, version, data_position, rng, prompts)

    def restore_rng(self) -> None:
        if self.rng:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(self.rng)), dtype=torch.uint8))


def save_trainer(actor: Actor, state: TrainerState, staging: Path,
                 describe: Callable[[Path], None] | None = None) -> Path:
    """Every rank writes its shards under ``staging/dcp`` (a critic's under ``staging/critic``); rank 0
    also writes the trainer state, the layout the shards were cut by
    (:attr:`~.actor.Actor.checkpoint_layout`) and, with ``describe``, the model's config and
    tokenizer under ``staging/model``."""
    actor.save_shards(staging / SHARDS_DIR)
    if actor.critic is not None:
        actor.critic.save(staging / CRITIC_DIR)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (staging / STATE_FILE).write_text(json.dumps(asdict(state) | {"layout": actor.checkpoint_layout}))
        if describe is not None:
            describe(staging / MODEL_DIR)
    return staging


def layout_mismatch(saved: dict[str, str | int], current: dict[str, str | int]) -> str | None:
    """Why shards cut by layout ``saved`` cannot load into an actor of layout ``current`` (None: they can)."""
    differ = [f"{k} {saved.get(k, '-')} → {current.get(k, '-')}" for k in sorted(saved.keys() | current.keys())
              if saved.get(k) != current.get(k)]
    if not differ:
        return None
    return (f"spec.trainer: the checkpoint's pieces were cut by another layout ({', '.join(differ)}); "
            "resume with the backend and parallelism it was written with, or start a new run")


def _holds(staging: Path, prefix: str) -> bool:
    """Whether the checkpoint's shards hold state under ``prefix`` (read from their metadata alone)."""
    saved = dcp.FileSystemReader(str(staging / SHARDS_DIR)).read_metadata().state_dict_metadata
    return any(key.startswith(prefix) for key in saved)


def load_trainer(actor: Actor, staging: Path) -> TrainerState:
    """Load shards and counters written by ``save_trainer`` into an actor built the same way (a
    different layout is refused, naming the field, before anything is read)."""
    saved_state = json.loads((staging / STATE_FILE).read_text())
    saved_layout = saved_state.pop("layout", None)  # None: written before layouts were recorded
    mismatch = saved_layout is not None and layout_mismatch(saved_layout, actor.checkpoint_layout)
    if mismatch:
        raise CheckpointError(mismatch)
    if actor.reference is not None and not _holds(staging, "reference."):
        raise CheckpointError("spec.algorithm.klCoef > 0 but the checkpoint has no reference policy (it was "
                              "written with klCoef 0); resume with klCoef 0 or start a new run")
    if actor.critic is not None and not (staging / CRITIC_DIR).is_dir():
        raise CheckpointError("spec.algorithm.name is ppo but the checkpoint has no critic (it was written by a "
                              "critic-free algorithm); resume with that algorithm or start a new run")
    actor.load_shards(staging / SHARDS_DIR)
    if actor.critic is not None:
        actor.critic.load(staging / CRITIC_DIR)
    state = TrainerState(**saved_state)
    state.restore_rng()
    return state


class Checkpointer:
    """Every ``every`` steps: all ranks write shards into their node's staging directory; one rank
    per node (``LOCAL_RANK`` 0) uploads that node's files, and global rank 0 writes the manifest once
    every node has uploaded, so a checkpoint is complete only when all of it is there. On resume,
    rank 0 picks the newest complete checkpoint and one rank per node downloads all of it (FSDP2 may
    re-shard, so a rank can need any file); the staging directory is per node, not shared.
    """

    def __init__(self, uri: str | None, every: int, keep: int, staging: Path, rank: int, local_rank: int = 0,
                 run_id: str | None = None, s3_endpoint: str | None = None,
                 describe: Callable[[Path], None] | None = None, signing_key: str = ""):
        """``describe``: writes the model's config and tokenizer into a directory (each checkpoint's
        ``model/``); ``signing_key``: signs the manifests and admits only those it signed ("": neither)."""
        self.every, self.staging, self.rank, self.local_rank = every, staging, rank, local_rank
        self.describe = describe
        self.run_id = run_id
        self.manager = (CheckpointManager(open_store(uri, endpoint=s3_endpoint), keep, run_id,
                                          signing_key.encode() or None)
                        if uri and local_rank == 0 else None)
        self.enabled = uri is not None

    def resume(self, actor: Actor) -> TrainerState | None:
        """Rank 0 downloads and verifies the newest complete checkpoint of this run (falling back to
        older ones), every rank learns its step (or rank 0's error), one rank per other node downloads
        the same one, and every rank loads it."""
        chosen: int | str | None = None
        if self.manager is not None and self.rank == 0:
            try:
                manifest = self.manager.restore_newest(self.staging, self.run_id)
                chosen = manifest.step if manifest is not None else None
            except CheckpointError as err:
                chosen = str(err)
        chosen = broadcast_from_rank0(chosen)
        if isinstance(chosen, str):
            raise CheckpointError(chosen)
        if chosen is None:
            return None
        where = self.staging / f"restore-{chosen}"
        if self.manager is not None and self.rank != 0:  # one download per other node
            manifest = next((m for m in self.manager.complete() if m.step == chosen), None)
            if manifest is None:
                raise CheckpointError(f"rank {self.rank} cannot see checkpoint step {chosen} that rank 0 resumes from")
            self.manager.restore(manifest, where)
        barrier()
        return load_trainer(actor, where)

    def due(self, step: int) -> bool:
        """A checkpoint is kept after ``step`` steps (every ``every``-th, when enabled)."""
        return self.enabled and step % self.every == 0

    def maybe_save(self, actor: Actor, step: int, version: int, data_position: int,
                   prompts: dict[str, Any] | None = None) -> str | None:
        """Checkpoint after ``step`` steps when it is due, with the data position and the prompt ledger
        as of now (``TrainerState``); returns the checkpoint URI on rank 0."""
        if not self.due(step):
            return None
        staging = self.staging / f"save-{step}"
        save_trainer(actor, TrainerState.capture(step, version, data_position, prompts), staging, self.describe)
        barrier()  # this node's files are all written
        started = time.perf_counter()
        entries = self.manager.upload_files(staging, step) if self.manager is not None else {}
        every_node = all_gather(entries)
        uri = None
        if self.rank == 0:
            assert self.manager is not None
            merged = {k: v for node in every_node for k, v in node.items()}
            uri = self.manager.commit(step, merged, {"version": version}, time.perf_counter() - started)
        if self.local_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        return uri
