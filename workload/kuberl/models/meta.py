"""A policy built without its weights (the ``meta`` device) and filled, after sharding, with only
each rank's own slices of the model's safetensors files.

``torch.distributed.checkpoint`` reads the files (``HuggingFaceStorageReader``: safetensors, mapped
from disk) into the sharded state dict, so a rank's host memory holds about its shard of the model,
not the whole model (``benchmarks/load_memory.py`` measures it). Tied parameters are loaded once;
buffers a checkpoint does not hold (rotary frequencies) are computed again from the config.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


class MetaLoadError(ValueError):
    """The model cannot be filled from its files; the message says which weights are missing."""


def is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def file_keys(directory: Path) -> set[str]:
    """The tensor names of every safetensors file in ``directory``."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            keys |= set(f.keys())
    return keys


def materialize(model: torch.nn.Module, directory: Path, device: torch.device, zeros: tuple[str, ...] = (),
                renamed: Callable[[str], str | None] = lambda name: name) -> None:
    """Give ``model`` (built on ``meta``, sharded or not) storage on ``device`` and fill it from the
    safetensors in ``directory``, each rank reading only its shards; tensors whose names start with
    one of ``zeros`` are zeros instead (a value head the policy's files lack). ``renamed`` gives a
    tensor's name in the files, or None for one the caller fills afterwards (a LoRA adapter:
    :func:`kuberl.models.lora.file_name`). Raises MetaLoadError if any other parameter is neither in
    the files nor tied to one that is."""
    groups = _tied_groups(model)
    model.to_empty(device=device)
    _retie(model, groups)
    state, present = model.state_dict(), file_keys(directory)
    with torch.no_grad():
        for name in (n for n in state if n.startswith(zeros)):  # startswith(()) is False
            model.get_parameter(name).zero_()
    in_files = {name: stored for name in state if (stored := renamed(name)) is not None}
    names = {in_files.get(name, name): {in_files.get(n, n) for n in group} for group in groups for name in group}
    wanted = {in_files[name]: tensor for name, tensor in state.items() if in_files.get(name) in present}
    missing = [name for name, stored in in_files.items() if stored not in present
               and not names.get(stored, set()) & present and not name.startswith(zeros)]
    if missing:
        raise MetaLoadError(f"{directory}: the safetensors files lack {missing[:5]} ({len(missing)} weights)")
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    _rebuild_buffers(model, device)


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
