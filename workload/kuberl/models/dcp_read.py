"""Reading the model's tensors from a ``torch.distributed.checkpoint`` directory some other run wrote
(``model.initFrom``, ``kuberl export``) without running any code it holds.

DCP keeps two pickles: the ``.metadata`` file (``pickle.load`` in ``FileSystemReader``) and every
non-tensor entry (``torch.load(weights_only=False)`` in the default load planner: the optimizer's
step, learning rates …). A checkpoint from another run is not signed with this run's key, so either
would unpickle files nobody checked: whoever can write the bucket could run code in the trainer.
Here ``.metadata`` goes through :class:`MetadataUnpickler`, which builds only DCP's own metadata
classes, ``torch.Size``, dtypes, layouts and paths (anything else: :class:`UnsafeCheckpoint`), and
only the ``model.*`` tensors are read — each with ``torch.load(weights_only=True)``, as DCP already
does for tensors. Byte entries are never asked for.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

MODEL_PREFIX = "model."  # the trainer checkpoints' model state (``{"model": …, "optim": …}``, flattened)
ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint's metadata names something DCP's metadata never holds; the message names it."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: ``find_class`` admits ``ALLOWED_GLOBALS`` and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"its DCP metadata asks for {module}.{name}, which checkpoint metadata never holds; "
                               "it was not read (start from the run's Hugging Face export instead: spec.export)")


class MetadataCheckedReader(dcp.FileSystemReader):
    """``FileSystemReader`` with its ``.metadata`` read by :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with path.open("rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the DCP checkpoint in ``directory``, whole, under its name without the
    prefix (one process, no process group); raises :class:`UnsafeCheckpoint`."""
    reader = MetadataCheckedReader(str(directory))
    entries = reader.read_metadata().state_dict_metadata
    wanted = {fqn.removeprefix(MODEL_PREFIX): torch.empty(meta.size, dtype=meta.properties.dtype)
              for fqn, meta in entries.items()
              if fqn.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    state = {"model": wanted}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]

