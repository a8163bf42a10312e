"""A policy built without its weights (the ``meta`` device) and filled, after sharding, with only
each rank's own slices of the model's safetensors files.

``torch.distributed.checkpoint`` reads the files (``HuggingFaceStorageReader``: safetensors, mapped
from disk) into the sharded state dict, so a rank's host memory holds about its shard of the model,
not the whole model (``benchmarks/load_memory.py`` measures it). Tied parameters are loaded once;
buffers a checkpoint does not hold (rotary frequencies) are computed again from the config. A
mixture of experts' stacked expert tensors (transformers stacks the files' per-expert tensors as it
loads them: :mod:`.file_layout`) are read expert by expert, each rank reading only its rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from . import file_layout


class MetaLoadError(ValueError):
    """The model cannot be filled from its files; the message says which weights are missing."""


def is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def file_index(directory: Path) -> dict[str, Path]:
    """Every tensor name in the safetensors files of ``directory`` → the file that holds it."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            index |= dict.fromkeys(f.keys(), path)
    return index


def materialize(model: torch.nn.Module, directory: Path, device: torch.device, zeros: tuple[str, ...] = (),
                renamed: Callable[[str], str | None] = lambda name: name) -> None:
    """Give ``model`` (built on ``meta``, sharded or not) storage on ``device`` and fill it from the
    safetensors in ``directory``, each rank reading only its shards; tensors whose names start with
    one of ``zeros`` are zeros instead (a value head the policy's files lack). ``renamed`` gives a
    tensor's name in the files, or None for one the caller fills afterwards (a LoRA adapter:
    :func:`kuberl.models.lora.file_name`); transformers' own conversions of the model's checkpoints
    (stacked experts, renamed modules: :mod:`.file_layout`) are undone on top. Raises MetaLoadError if
    any other parameter is neither in the files nor tied to one that is."""
    groups = _tied_groups(model)
    model.to_empty(device=device)
    _retie(model, groups)
    state, files = model.state_dict(), file_index(directory)
    with torch.no_grad():
        for name in (n for n in state if n.startswith(zeros)):  # startswith(()) is False
            model.get_parameter(name).zero_()
    in_files, stacks, to_file = _names_in_files(directory, model, state, renamed)
    shapes = {name: tensor.shape for name, tensor in state.items()}
    _refuse_missing(directory, _missing_weights(shapes, in_files, stacks, files, groups, to_file, zeros))
    wanted = {in_files[name]: tensor for name, tensor in state.items() if in_files.get(name) in files}
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    _fill_stacked(model, stacks, files, to_file)
    _rebuild_buffers(model, device)


def _model_type(model: torch.nn.Module) -> str:
    """The HF ``model_type`` whose checkpoint conversions apply (none known: "")."""
    return str(getattr(getattr(model, "config", None), "model_type", ""))


def _names_in_files(directory: Path, model: torch.nn.Module, state: Mapping[str, Any],
                    renamed: Callable[[str], str | None] = lambda name: name
                    ) -> tuple[dict[str, str], dict[str, tuple[str, ...]], Callable[[str], str]]:
    """(each parameter read under one name → that name in the files, each stacked parameter → its
    per-expert sources, model-side name → name in the files) for ``state``'s tensors; MetaLoadError
    naming ``directory`` for a conversion :mod:`.file_layout` cannot undo."""
    model_type = _model_type(model)
    to_file = file_layout.renaming(model_type)
    stored = {name: own for name in state if (own := renamed(name)) is not None}
    try:
        stacks_by_stored = file_layout.stacked(model_type, stored.values())
    except file_layout.UnsupportedConversion as err:
        raise MetaLoadError(f"{directory}: {err}") from err
    in_files = {name: to_file(own) for name, own in stored.items() if own not in stacks_by_stored}
    stacks = {name: stacks_by_stored[own] for name, own in stored.items() if own in stacks_by_stored}
    return in_files, stacks, to_file


def _missing_weights(shapes: Mapping[str, torch.Size], in_files: dict[str, str], stacks: dict[str, tuple[str, ...]],
                     files: Mapping[str, Path], groups: list[list[str]], to_file: Callable[[str], str],
                     zeros: tuple[str, ...] = ()) -> list[str]:
    """The parameters (of ``shapes``: name → shape) neither in ``files`` nor tied to one that is, nor
    zero-filled (``zeros``), and each stacked parameter's per-expert tensors the files lack."""
    names = {in_files.get(name, name): {in_files.get(n, n) for n in group} for group in groups for name in group}
    missing = [name for name, stored in in_files.items() if stored not in files
               and not names.get(stored, set()) & files.keys() and not name.startswith(zeros)]
    return missing + [f"{name} ({source})" for name, sources in stacks.items()
                      for row in range(shapes[name][0]) for source in file_layout.source_names(sources, row)
                      if to_file(source) not in files]  # fmt: skip


def _refuse_missing(directory: Path, missing: list[str]) -> None:
    if missing:
        raise MetaLoadError(f"{directory}: the safetensors files lack {missing[:5]} ({len(missing)} weights)")


class FileReader(contextlib.AbstractContextManager["FileReader"]):
    """Tensors read one at a time from a model's safetensors files, under the model's names
    (``to_file`` gives a name in the files: :func:`.file_layout.renaming`); a stacked parameter's row
    assembled from its per-expert sources (:func:`.file_layout.stacked`). Files stay open (mapped)
    until the reader closes."""

    def __init__(self, files: dict[str, Path], to_file: Callable[[str], str]) -> None:
        self.files, self.to_file = files, to_file
        self._opened = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored = self.to_file(name)
        path = self.files[stored]
        if path not in self._handles:
            self._handles[path] = self._opened.enter_context(safe_open(path, "pt"))
        return self._handles[path].get_tensor(stored)

    def row(self, sources: tuple[str, ...], index: int) -> torch.Tensor:
        return torch.cat([self.read(source) for source in file_layout.source_names(sources, index)])

    def __exit__(self, *exc: object) -> None:
        self._opened.close()


class FileState(Mapping[str, torch.Tensor]):
    """The state dict of ``model`` (built on ``meta``: its names, shapes and config) read from the
    safetensors in ``directory`` on demand — a tensor at a time, stacked experts assembled from the
    files' per-expert tensors — so a reader that converts it piece by piece holds one piece, not the
    model. Use as a context manager (the files are closed at its end). Raises MetaLoadError, listing
    them, when the files lack weights the model has (as :func:`materialize` does)."""

    def __init__(self, directory: Path, model: torch.nn.Module) -> None:
        shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
        files = file_index(directory)
        in_files, self.stacks, to_file = _names_in_files(directory, model, shapes)
        _refuse_missing(directory, _missing_weights(shapes, in_files, self.stacks, files, _tied_groups(model), to_file))
        self.rows = {name: shapes[name][0] for name in self.stacks}
        self.names = {n: None for n in shapes if n in self.stacks or to_file(n) in files}  # ordered
        self.reader = FileReader(files, to_file)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.stacks:
            return torch.stack([self.reader.row(self.stacks[name], j) for j in range(self.rows[name])])
        if name not in self.names:
            raise KeyError(name)
        return self.reader.read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __enter__(self) -> FileState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.__exit__(*exc)


def _fill_stacked(model: torch.nn.Module, stacks: dict[str, tuple[str, ...]], files: dict[str, Path],
                  to_file: Callable[[str], str]) -> None:
    """Each stacked parameter's rows this rank holds, read expert by expert from the files."""
    with FileReader(files, to_file) as reader:
        for name, sources in stacks.items():
            local, first = local_rows(model.get_parameter(name))
            with torch.no_grad():
                for row in range(local.shape[0]):
                    local[row].copy_(reader.row(sources, first + row))


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``tensor`` — a DTensor's local shard (FSDP2 shards dimension 0), or the
    whole tensor — and the index of the first in the whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, 0
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offset[1:]):
        raise MetaLoadError(f"a tensor of shape {tuple(tensor.shape)} is sharded along more than its rows")
    return tensor.to_local(), int(offset[0])


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter (tied weights have several)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def _retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Tied weights tied again: ``to_empty`` gives an unsharded module's aliases storage of their own
    (FSDP2's parameters keep theirs)."""
    for first, *others in (g for g in groups if len(g) > 1):
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (not in any checkpoint: e.g. the rotary embedding's ``inv_freq``) as the
    module's constructor computes them from its config."""
    for module in model.modules():
        own = [name for name in module._non_persistent_buffers_set if getattr(module, name, None) is not None]
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise MetaLoadError(f"{type(module).__name__}: cannot recompute its buffers {own} (no config)")
        with torch.device("cpu"):
            fresh = type(module)(config)
        for name in own:
            setattr(module, name, getattr(fresh, name).to(device))
