"""Load the policy named by ``spec.model``: a builtin (``builtin:tiny-qwen2``, ``builtin:tiny-qwen2-chat``,
``builtin:tiny-qwen3-moe``, ``builtin:tiny-qwen2-arithmetic``: :mod:`.pretrained`) or a `from_pretrained` directory.

``file:///path`` and plain paths load with ``from_pretrained`` (weights and tokenizer from disk);
an ``s3://bucket/prefix/`` is first copied into the node-local cache (:mod:`kuberl.remote`) and an
``hf://ORG/NAME[@REVISION]`` downloaded from the hub into it (:mod:`.hub`), the same way in trainer
and inference pods. ``spec.model.chatTemplate.template`` replaces the tokenizer's template here, so
every consumer of the tokenizer (rollout, gateway, engines) renders with the same one. The weights
come from ``spec.model.initFrom`` when it is set: an HF directory, or another run's FSDP2 checkpoint
read into one (:func:`weights_dir`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..api.spec import ModelSource
from ..checkpoint.layout import is_trainer_checkpoint
from ..remote import RemoteError, local_copy
from ..settings import DEFAULTS, Settings
from .hf_dir import CheckpointReadError, checkpoint_as_hf_dir
from .hub import HubError, config_file, parse_hub_path, resolved_revision, snapshot
from .pretrained import tiny_qwen2_arithmetic
from .tiny import char_tokenizer, chat_tokenizer, tiny_qwen2, tiny_qwen3_moe

BUILTIN = {"builtin:tiny-qwen2": tiny_qwen2, "builtin:tiny-qwen2-chat": tiny_qwen2,
           "builtin:tiny-qwen3-moe": tiny_qwen3_moe,
           "builtin:tiny-qwen2-arithmetic": tiny_qwen2_arithmetic}  # name → (vocab, seed) → model
BUILTIN_TOKENIZERS = {"builtin:tiny-qwen2-chat": chat_tokenizer}  # the others: char_tokenizer
BUILTIN_SHAPES = BUILTIN | {"builtin:tiny-qwen2-arithmetic": tiny_qwen2}  # its architecture, not its pre-training


class ModelLoadError(ValueError):
    """The model or tokenizer named in spec.model cannot be loaded; the message says why."""


def local_dir(uri: str, field: str, settings: Settings) -> Path:
    """The local directory of a ``file://`` / plain path, or of an ``s3://`` prefix or ``hf://`` model
    (downloaded once per node)."""
    if parse_hub_path(uri) is not None:
        try:
            return snapshot(uri, field, settings)
        except HubError as err:
            raise ModelLoadError(str(err)) from err
    if uri.startswith("s3://"):
        try:
            return local_copy(uri if uri.endswith("/") else uri + "/", settings)
        except RemoteError as err:
            raise ModelLoadError(f"{field}: {err}") from err  # the error names the URI
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise ModelLoadError(
            f"{field} {uri!r} is not a local directory; KubeRL loads models from file:// paths, s3:// "
            f"prefixes, hf://ORG/NAME hub models or {', '.join(sorted(BUILTIN))}"
        )
    return path


def load_tokenizer(source: ModelSource, settings: Settings = DEFAULTS) -> PreTrainedTokenizerBase:
    """The tokenizer, with ``spec.model.chatTemplate.template`` as its chat template when given."""
    uri = source.tokenizer or source.path
    if uri in BUILTIN:
        tok = BUILTIN_TOKENIZERS.get(uri, char_tokenizer)()
    else:
        field = "spec.model.tokenizer" if source.tokenizer else "spec.model.path"
        tok = AutoTokenizer.from_pretrained(local_dir(uri, field, settings), padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if source.chat_template.template is not None:
        tok.chat_template = source.chat_template.template
    return tok


def weights_source(source: ModelSource) -> tuple[str, str]:
    """(location, field) of the weights a run starts from: ``spec.model.initFrom``, else ``spec.model.path``."""
    return (source.init_from, "spec.model.initFrom") if source.init_from else (source.path, "spec.model.path")


def weights_dir(source: ModelSource, settings: Settings = DEFAULTS) -> Path:
    """The local HF directory of the weights a run starts from (not a builtin): ``model.path``'s, or
    ``model.initFrom``'s — an HF directory as it is, another run's FSDP2 checkpoint (``…/step-N/``)
    read into one in the node's cache."""
    uri, field = weights_source(source)
    directory = local_dir(uri, field, settings)
    if field == "spec.model.initFrom" and is_trainer_checkpoint(directory):
        try:
            return checkpoint_as_hf_dir(directory, settings.cache_dir, field)
        except CheckpointReadError as err:
            raise ModelLoadError(str(err)) from err
    return directory


def load_model(source: ModelSource, seed: int, settings: Settings = DEFAULTS
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy model (float32, train mode off; its weights from :func:`weights_source`) and its
    tokenizer (an s3:// source through ``settings``' cache and endpoint)."""
    tokenizer = load_tokenizer(source, settings)
    uri, _ = weights_source(source)
    if uri in BUILTIN:
        model = BUILTIN[uri](len(tokenizer), seed)
    else:
        # float32 explicitly: transformers ≥ 5 would otherwise load the checkpoint's own dtype ("auto")
        model = AutoModelForCausalLM.from_pretrained(weights_dir(source, settings), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def load_skeleton(source: ModelSource, seed: int, settings: Settings = DEFAULTS
                  ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path | None]:
    """The policy without its weights (``meta`` device), its tokenizer and the directory its weights
    are in, for a trainer that shards before it loads (:mod:`.meta`); a builtin is built whole (it is
    tiny and generated from the seed, so every rank builds the same), with no directory."""
    uri, _ = weights_source(source)
    if uri in BUILTIN:
        model, tokenizer = load_model(source, seed, settings)
        return model, tokenizer, None
    tokenizer = load_tokenizer(source, settings)
    directory = weights_dir(source, settings)
    model = on_meta(AutoConfig.from_pretrained(directory))
    model.eval()
    return model, tokenizer, directory


def on_meta(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM of ``config`` on the ``meta`` device: its modules, names and shapes, no storage."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_origin(source: ModelSource, tokenizer: PreTrainedTokenizerBase) -> dict[str, str | None]:
    """Where the policy came from, for the summary and status: ``spec.model.path``, the weights it
    started from (``initFrom``) and, for an
    ``hf://`` model, the commit its snapshot holds (read off the tokenizer's directory when the
    tokenizer came from the same place)."""
    same_place = source.tokenizer is None and parse_hub_path(source.path) is not None
    revision = resolved_revision(Path(tokenizer.name_or_path)) if same_place else None
    return {"path": source.path, "revision": revision, "init_from": source.init_from}


def model_shape(source: ModelSource, settings: Settings = DEFAULTS) -> PreTrainedModel | None:
    """The architecture of ``spec.model.path`` without its weights (``meta``), read from its config alone
    — a local directory's ``config.json``, an ``hf://`` model's (that one file downloaded), a builtin's
    constructor — for ``kuberl validate``'s model checks; None for an ``s3://`` model or a path that is
    not a directory here (a volume's path in the pods, say): their config is read where the run starts.
    Raises ModelLoadError."""
    uri, field = source.path, "spec.model.path"
    if uri.startswith("s3://") or (uri not in BUILTIN_SHAPES and parse_hub_path(uri) is None
                                   and not Path(uri.removeprefix("file://")).is_dir()):
        return None
    if uri in BUILTIN_SHAPES:
        with torch.device("meta"):
            return BUILTIN_SHAPES[uri](len(BUILTIN_TOKENIZERS.get(uri, char_tokenizer)()), 0)
    if parse_hub_path(uri) is None:
        return on_meta(AutoConfig.from_pretrained(local_dir(uri, field, settings)))
    try:
        return on_meta(AutoConfig.from_pretrained(config_file(uri, field, settings).parent))
    except HubError as err:
        raise ModelLoadError(str(err)) from err

