"""Checkpoints in S3 or a directory: ``open_store(uri)`` + ``CheckpointManager`` (manifest last)."""

from .manager import CheckpointManager, ForeignCheckpoint, Manifest
from .store import CheckpointError, LocalStore, S3Store, Store, open_store

__all__ = [
    "CheckpointError", "CheckpointManager", "ForeignCheckpoint", "LocalStore", "Manifest", "S3Store", "Store",
    "open_store",
]
