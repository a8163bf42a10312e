"""What a trainer checkpoint's directory holds (``step-NNNNNNNN/``), for the trainer that writes and
resumes it and for those that read its weights elsewhere (``kuberl export``, ``model.initFrom``)."""

from __future__ import annotations

import json
from pathlib import Path

STATE_FILE = "trainer_state.json"  # step, version, RNG, the prompt ledger, and the backend's layout
SHARDS_DIR = "dcp"  # model + optimizer state: torch.distributed.checkpoint (FSDP2) or dist_checkpointing (Megatron)
MODEL_DIR = "model"  # the model's config and tokenizer (kuberl.models.hf_dir.describe_model)
CRITIC_DIR = "critic"  # ppo's value model + its optimizer: torch.distributed.checkpoint, whatever the backend


def is_trainer_checkpoint(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file() and (directory / SHARDS_DIR).is_dir()


def checkpoint_layout(directory: Path) -> dict[str, str | int]:
    """The layout the checkpoint in ``directory`` was cut by ({} for those from before layouts)."""
    return json.loads((directory / STATE_FILE).read_text()).get("layout") or {}


def checkpoint_backend(directory: Path) -> str:
    """The backend that wrote the checkpoint in ``directory`` (``fsdp`` for those from before layouts)."""
    return str(checkpoint_layout(directory).get("backend", "fsdp"))
