"""LoRA adapters (``spec.trainer.lora``) on an HF causal LM, through ``peft``, the same way in the
trainer and the torch engine.

:func:`add_adapter` replaces each targeted ``nn.Linear`` by peft's LoRA layer in place: its base
weight moves to ``<module>.base_layer.weight`` (frozen) and the adapter's to
``<module>.lora_A.default.weight`` [r, in] and ``<module>.lora_B.default.weight`` [out, r]; the
layer computes y = W x + s · B (A x), s = alpha ÷ r. Trainer and engine carry the same names, so an
update is the adapter's tensors under those names. The engine keeps the adapter unmerged: the
same computation as the trainer (its log-probs match the engine's as without LoRA), an update
copies a few MB instead of rewriting W, and W is never rounded again in the serving dtype.

An export writes the policy merged (:func:`merged`: W' = W + s · B A, HF names) and the adapter in
PEFT's format (:func:`peft_files`: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable
by ``PeftModel.from_pretrained`` on the base).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from ..api.lora import ALL_LINEAR, LoraSpec

ADAPTER = "default"  # peft's name for the one adapter
BASE = ".base_layer"
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
PEFT_PREFIX = "base_model.model."  # how PeftModel names the wrapped model's modules in its files


class AdapterError(ValueError):
    """The adapter cannot be put on this model; the message names the field."""


def peft_config(spec: LoraSpec, targets: str | list[str], **extra: Any) -> Any:
    """peft's ``LoraConfig`` of ``spec`` on ``targets`` (``extra``: further LoraConfig fields)."""
    import peft

    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.effective_alpha, lora_dropout=spec.dropout,
                           target_modules=targets, bias="none", **extra)


def add_adapter(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Put a LoRA adapter on ``model`` in place (A random as peft draws it, B zero: the policy is
    unchanged) and freeze everything else. Raises AdapterError when no module matches."""
    import peft

    targets: str | list[str] = ALL_LINEAR if spec.target_modules == [ALL_LINEAR] else list(spec.target_modules)
    try:
        peft.inject_adapter_in_model(peft_config(spec, targets), model)
    except ValueError as err:  # peft: "Target modules … not found in the base model"
        raise AdapterError(f"spec.trainer.lora.targetModules {spec.target_modules}: {err}") from err
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_weight(name))
    return model


def is_adapter_weight(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def has_adapter(model: torch.nn.Module) -> bool:
    return any(is_adapter_weight(name) for name, _ in model.named_parameters())


def adapter_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's entries of a state dict (names as :func:`add_adapter` gives them)."""
    return {name: t for name, t in state.items() if is_adapter_weight(name)}


def file_name(name: str) -> str | None:
    """The name a weight of the adapted model has in the base model's files (``…q_proj.base_layer.weight``
    → ``…q_proj.weight``); None for the adapter's weights, which the files do not hold."""
    return None if is_adapter_weight(name) else name.replace(BASE + ".", ".")


def merged(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The adapted model's full state dict as the base model's HF state dict with the adapter folded
    in: W' = W + scaling · B A for each adapted layer (in float32, then W's dtype), every other
    tensor as it is, names as in the base model's files."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_weight(name):
            continue
        module = name.removesuffix(f"{BASE}.weight")
        if module != name and module + LORA_A in state:
            delta = state[module + LORA_B].float() @ state[module + LORA_A].float()
            tensor = (tensor.float() + scaling * delta).to(tensor.dtype)
        out[file_name(name) or name] = tensor
    return out


def init_adapter(model: torch.nn.Module, seed: int) -> None:
    """Fill the adapter of a model whose storage was just allocated (built on ``meta``): A as
    ``nn.Linear`` draws its weight (Kaiming uniform, a = √5: U(±1/√in)), from a generator seeded by
    ``seed`` and the weight's name so that every rank draws the same; B zero. Each rank writes its own
    shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter_weight(name):
                continue
            full = torch.zeros(param.shape, dtype=param.dtype)
            if name.endswith(LORA_A):
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                bound = 1.0 / math.sqrt(param.shape[1])
                full.uniform_(-bound, bound, generator=generator)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(full)
            else:
                param.copy_(full)


def peft_files(state: dict[str, torch.Tensor], spec: LoraSpec, base_model: str, directory: Path) -> None:
    """Write the adapter of ``state`` (any state dict of the adapted model) in PEFT's format into
    ``directory``: ``adapter_model.safetensors`` (names ``base_model.model.<module>.lora_A.weight``)
    and ``adapter_config.json`` (``base_model`` as ``base_model_name_or_path``)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): t.detach().contiguous()
               for name, t in adapter_only(state).items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = sorted({name.removesuffix(LORA_A).rsplit(".", 1)[-1] for name in state if name.endswith(LORA_A)})
    config = peft_config(spec, targets, base_model_name_or_path=base_model, task_type="CAUSAL_LM")
    body: dict[str, Any] = config.to_dict()
    (directory / "adapter_config.json").write_text(json.dumps(body, indent=2, sort_keys=True, default=list))
