"""Load the policy named by ``spec.model``: a builtin (``builtin:tiny-qwen2``, ``builtin:tiny-qwen3-moe``)
or a `from_pretrained` directory.

``file:///path`` and plain paths load with ``from_pretrained`` (weights and tokenizer from disk);
an ``s3://bucket/prefix/`` is first copied into the node-local cache (:mod:`kuberl.remote`), the
same way in trainer and inference pods. Nothing is ever downloaded from a model hub: a hub id that
is not a local directory is an error that says so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..api.spec import ModelSource
from ..remote import RemoteError, local_copy
from ..settings import DEFAULTS, Settings
from .tiny import char_tokenizer, tiny_qwen2, tiny_qwen3_moe

BUILTIN = {"builtin:tiny-qwen2": tiny_qwen2, "builtin:tiny-qwen3-moe": tiny_qwen3_moe}  # name → (vocab, seed) → model


class ModelLoadError(ValueError):
    """The model or tokenizer named in spec.model cannot be loaded; the message says why."""


def local_dir(uri: str, field: str, settings: Settings) -> Path:
    """The local directory of a ``file://`` / plain path, or of an ``s3://`` prefix (downloaded once)."""
    if uri.startswith("s3://"):
        try:
            return local_copy(uri if uri.endswith("/") else uri + "/", settings)
        except RemoteError as err:
            raise ModelLoadError(f"{field}: {err}") from err  # the error names the URI
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise ModelLoadError(
            f"{field} {uri!r} is not a local directory; KubeRL loads models from file:// paths, s3:// "
            f"prefixes or {', '.join(sorted(BUILTIN))} and never downloads from a hub at run time"
        )
    return path


def load_tokenizer(source: ModelSource, settings: Settings = DEFAULTS) -> PreTrainedTokenizerBase:
    uri = source.tokenizer or source.path
    if uri in BUILTIN:
        return char_tokenizer()
    field = "spec.model.tokenizer" if source.tokenizer else "spec.model.path"
    tok = AutoTokenizer.from_pretrained(local_dir(uri, field, settings), padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, seed: int, settings: Settings = DEFAULTS
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy model (float32, train mode off) and its tokenizer (an s3:// source through
    ``settings``' cache and endpoint)."""
    tokenizer = load_tokenizer(source, settings)
    if source.path in BUILTIN:
        model = BUILTIN[source.path](len(tokenizer), seed)
    else:
        # float32 explicitly: transformers ≥ 5 would otherwise load the checkpoint's own dtype ("auto")
        model = AutoModelForCausalLM.from_pretrained(local_dir(source.path, "spec.model.path", settings),
                                                     dtype=torch.float32)
    model.eval()
    return model, tokenizer
