"""The policy as a Hugging Face model directory (``spec.export``): what a team serves, evaluates or
shares after a run, ``AutoModelForCausalLM.from_pretrained``-ready.

Written beside the checkpoints, ``<checkpoint location>hf/step-NNNNNNNN/``: ``config.json``,
``generation_config.json``, the weights as sharded safetensors with their index
(``huggingface_hub.save_torch_state_dict``; tied weights once), the tokenizer files with the chat
template (:mod:`kuberl.models.hf_dir`) — then ``MANIFEST.json`` last, through the same protocol as checkpoints
(``kuberl.checkpoint.CheckpointManager``), so a reader never sees half an export. A ``ppo`` run's
value model goes beside the policy, in ``value/`` (``AutoModelForTokenClassification``-ready, one
label). A LoRA run (``spec.trainer.lora``) writes its adapter in PEFT's format in ``adapter/``
(``PeftModel.from_pretrained``-ready on the base model) and, unless ``lora.exportMerged`` is false, the
policy with the adapter merged at the top as above. Every backend's ``full_state_dict`` already
gives whole tensors under HF names on rank 0 (Megatron's tensor-, pipeline- and expert-parallel
pieces gathered and renamed), so one writer serves both.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ..api.sources import ExportDtype
from ..api.spec import ExportSpec
from ..checkpoint import CheckpointManager, open_store
from ..models.hf_dir import describe_model, write_hf_dir
from ..models.lora import peft_files
from ..policy.actor import Actor

log = logging.getLogger("kuberl.trainer")
EXPORT_DIR = "hf/"
VALUE_DIR = "value"
ADAPTER_DIR = "adapter"
KEEP_ALL = 10**9  # exports are never pruned: each is a model someone may serve
DTYPES = {ExportDtype.BFLOAT16: torch.bfloat16, ExportDtype.FLOAT32: torch.float32}
__all__ = ["describe_model", "export_due", "export_policy", "write_hf_dir"]


def hf_config(actor: Actor) -> PretrainedConfig:
    """The HF config of the policy an actor trains (Megatron keeps it beside its converted model)."""
    return getattr(actor, "hf_config", None) or actor.model.config


def export_policy(actor: Actor, tokenizer: PreTrainedTokenizerBase, step: int, location: str | None,
                  spec: ExportSpec, staging: Path, run_id: str | None, rank: int,
                  s3_endpoint: str | None = None, base_model: str = "") -> dict[str, Any] | None:
    """Every rank calls it (the weights are gathered); rank 0 writes and uploads the export of ``step``
    and returns {"uri", "step", "bytes", "seconds"}; None on the other ranks or without a location.
    ``base_model``: what an adapter's ``adapter_config.json`` names as its base (``spec.model.path``)."""
    started = time.perf_counter()
    merged = actor.adapter is None or actor.adapter.export_merged
    state, values = actor.full_state_dict() if merged else {}, actor.critic_state_dict()
    adapter = actor.weight_source().full_state_dict() if actor.adapter is not None else {}
    if rank != 0 or location is None:
        return None
    where = staging / f"hf-{step}"
    shutil.rmtree(where, ignore_errors=True)
    if merged:
        write_hf_dir(state, hf_config(actor), tokenizer, where, DTYPES[spec.dtype])
    if actor.adapter is not None:
        peft_files(adapter, actor.adapter, base_model, where / ADAPTER_DIR)
    if values and actor.critic is not None:
        write_hf_dir(values, actor.critic.model.config, tokenizer, where / VALUE_DIR, DTYPES[spec.dtype])
    size = sum(p.stat().st_size for p in where.rglob("*") if p.is_file())
    manager = CheckpointManager(open_store(location.rstrip("/") + "/" + EXPORT_DIR, endpoint=s3_endpoint),
                                KEEP_ALL, run_id)
    kind = "huggingface" if merged else "peft-adapter"
    uri = manager.save(where, step, {"kind": kind, "dtype": spec.dtype.value})
    shutil.rmtree(where, ignore_errors=True)
    seconds = round(time.perf_counter() - started, 3)
    log.info("exported the policy of step %d as a Hugging Face model: %s (%.1f MiB, %.2f s)", step, uri,
             size / 2**20, seconds)
    return {"uri": uri, "step": step, "bytes": size, "seconds": seconds}


def export_due(spec: ExportSpec, step: int, checkpoint_every: int, last: bool) -> bool:
    """After ``step`` steps: the final export (``last``), or every ``everyCheckpoints``-th checkpoint's."""
    every = spec.every_checkpoints * checkpoint_every
    return (last and spec.final) or (every > 0 and step % every == 0)
