"""Hugging Face model directories: writing one (``describe_model`` + ``write_hf_dir``: what
``spec.export`` and ``kuberl export`` produce) and reading a trainer checkpoint as one
(``checkpoint_as_hf_dir``: ``model.initFrom`` naming another run's checkpoint)."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from ..checkpoint.layout import MODEL_DIR, SHARDS_DIR, checkpoint_backend, checkpoint_layout
from ..remote import exclusive
from . import file_layout
from .dcp_read import UnsafeCheckpoint, model_tensors

log = logging.getLogger("kuberl.models")
COMPLETE = ".complete"  # written last into a converted directory in the cache


class CheckpointReadError(ValueError):
    """A checkpoint whose weights cannot be read as a model here; the message says why."""


def describe_model(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, directory: Path,
                   dtype: torch.dtype | None = None) -> None:
    """Everything of a model directory but its weights: config (with ``dtype``), generation config,
    tokenizer files with the chat template. Checkpoints carry it too (``model/``), so their weights
    can become a directory again (``kuberl export``, ``model.initFrom``)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config.__class__.from_dict(config.to_dict())  # a copy: the run's own config stays as it is
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_hf_dir(state: dict[str, torch.Tensor], config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 directory: Path, dtype: torch.dtype) -> None:
    """``state`` (HF names) as a ``from_pretrained`` directory in ``dtype`` (sharded safetensors with
    their index, ``huggingface_hub.save_torch_state_dict``; tied weights once; a mixture of experts'
    stacked tensors one per expert, as the hub's checkpoints and ``save_pretrained`` have them:
    :func:`.file_layout.in_files`)."""
    from huggingface_hub import save_torch_state_dict

    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # the embedding holds it
    describe_model(config, tokenizer, directory, dtype)
    save_torch_state_dict(file_layout.in_files(state, config.model_type, dtype), directory)  # as save_pretrained


def saved_description(checkpoint: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase] | None:
    """(config, tokenizer) a trainer checkpoint carries (``model/``: :func:`describe_model`), or None
    for one written before checkpoints carried them."""
    if not (checkpoint / MODEL_DIR / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(checkpoint / MODEL_DIR), AutoTokenizer.from_pretrained(checkpoint / MODEL_DIR)


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors under HF names from an FSDP2 checkpoint's shards (no process group),
    read without unpickling anything but DCP's own metadata (:mod:`.dcp_read`: the checkpoint is
    another run's, unsigned for this one); the optimizer's state is left out."""
    backend = checkpoint_backend(checkpoint)
    if backend != "fsdp":
        raise CheckpointReadError(f"the checkpoint was written by backend {backend}; its weights are read from "
                                  "FSDP2 checkpoints only (a Megatron run exports itself: spec.export)")
    if "adapter" in checkpoint_layout(checkpoint):
        raise CheckpointReadError("the checkpoint holds a LoRA adapter (spec.trainer.lora), not the model's weights; "
                                  "use the run's export (spec.export: the merged model, and the adapter in adapter/)")
    try:
        return model_tensors(checkpoint / SHARDS_DIR)
    except UnsafeCheckpoint as err:
        raise CheckpointReadError(str(err)) from err


def checkpoint_as_hf_dir(checkpoint: Path, cache: Path, field: str) -> Path:
    """The trainer checkpoint in ``checkpoint`` as a float32 HF directory under ``cache`` (converted
    once per node, under a lock: every rank and replica of the node shares it)."""
    description = saved_description(checkpoint)
    if description is None:
        raise CheckpointReadError(f"{field}: the checkpoint holds no model description (it predates them); make it a "
                                  "Hugging Face directory first: kuberl export CHECKPOINT_URI OUT_URI --model PATH")
    key = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:16]
    target = cache / "init-from" / key
    with exclusive(target.with_suffix(".lock")):
        if (target / COMPLETE).is_file():
            return target
        shutil.rmtree(target, ignore_errors=True)
        log.info("%s: reading the weights of checkpoint %s into %s", field, checkpoint, target)
        try:
            state = checkpoint_weights(checkpoint)
        except CheckpointReadError as err:
            raise CheckpointReadError(f"{field}: {err}") from err
        write_hf_dir(state, *description, target, torch.float32)
        (target / COMPLETE).write_text(str(checkpoint))
    return target
