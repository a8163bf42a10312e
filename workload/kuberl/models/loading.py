"""Load the policy named by ``spec.model``: ``builtin:tiny-qwen2`` or a `from_pretrained` directory.

``file:///path`` and plain paths load with ``from_pretrained`` (weights and tokenizer from disk).
Nothing is ever downloaded at run time: a hub id that is not a local directory is an error that
says so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..api.spec import ModelSource
from .tiny import char_tokenizer, tiny_qwen2

BUILTIN = {"builtin:tiny-qwen2"}


class ModelLoadError(ValueError):
    """The model or tokenizer named in spec.model cannot be loaded; the message says why."""


def local_dir(uri: str, field: str) -> Path:
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise ModelLoadError(
            f"{field} {uri!r} is not a local directory; KubeRL loads models from file:// paths, s3:// "
            f"prefixes or {', '.join(sorted(BUILTIN))} and never downloads from a hub at run time"
        )
    return path


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    uri = source.tokenizer or source.path
    if uri in BUILTIN:
        return char_tokenizer()
    tok = AutoTokenizer.from_pretrained(local_dir(uri, "spec.model.tokenizer"), padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy model (float32, train mode off) and its tokenizer."""
    tokenizer = load_tokenizer(source)
    if source.path in BUILTIN:
        model = tiny_qwen2(len(tokenizer), seed)
    elif source.path.startswith("s3://"):
        raise ModelLoadError(f"spec.model.path {source.path!r}: s3:// model loading is not implemented yet")
    else:
        # float32 explicitly: transformers ≥ 5 would otherwise load the checkpoint's own dtype ("auto")
        model = AutoModelForCausalLM.from_pretrained(local_dir(source.path, "spec.model.path"), dtype=torch.float32)
    model.eval()
    return model, tokenizer
