"""``kuberl export CHECKPOINT_URI OUT_URI``: a finished FSDP2 checkpoint as a Hugging Face model
directory, offline, on one CPU — for a run that ended before ``spec.export`` existed, or a step other
than the last.

Reads top-down: find the checkpoint's manifest and download it (every SHA-256 checked), gather its
sharded weights into whole tensors (:func:`kuberl.models.hf_dir.checkpoint_weights`), take the
model's config and tokenizer from the checkpoint (``model/``, written with every checkpoint since
this command exists) or from ``--model``, write the directory (:func:`kuberl.models.hf_dir.write_hf_dir`)
and upload it, manifest last.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from ..api.spec import ModelSource
from ..checkpoint import CheckpointError, CheckpointManager, Manifest, open_store
from ..checkpoint.manager import MANIFEST, sha256
from ..models.hf_dir import CheckpointReadError, checkpoint_weights, saved_description, write_hf_dir
from ..models.loading import load_skeleton
from ..settings import Settings
from .export import DTYPES

_STEP = re.compile(r"^(?P<root>.+/)step-(?P<step>\d{8})/?$")


def export_checkpoint(checkpoint_uri: str, out_uri: str, model: str | None, dtype: str, settings: Settings) -> str:
    """Write the HF directory of ``checkpoint_uri`` (``…/step-NNNNNNNN/``) to ``out_uri``; returns it."""
    with tempfile.TemporaryDirectory(prefix="kuberl-export-") as tmp:
        work = Path(tmp)
        where, step = download(checkpoint_uri, work / "checkpoint", settings)
        try:
            state = checkpoint_weights(where)
        except CheckpointReadError as err:
            raise CheckpointError(str(err)) from err
        config, tokenizer = model_description(where, model, settings)
        write_hf_dir(state, config, tokenizer, work / "hf", DTYPES[dtype])
        return upload(work / "hf", out_uri, step, settings, {"kind": "huggingface", "dtype": dtype,
                                                              "source": checkpoint_uri.rstrip("/") + "/"})


def download(checkpoint_uri: str, dest: Path, settings: Settings) -> tuple[Path, int]:
    """The checkpoint's files, verified, in ``dest``; and its step."""
    match = _STEP.match(checkpoint_uri)
    if match is None:
        raise CheckpointError(f"{checkpoint_uri!r}: name one checkpoint, …/step-NNNNNNNN/ (spec.checkpoint.uri + step)")
    manager = CheckpointManager(open_store(match["root"], endpoint=settings.s3_endpoint))
    step = int(match["step"])
    manifest = next((m for m in manager.complete() if m.step == step), None)
    if manifest is None:
        raise CheckpointError(f"{checkpoint_uri!r}: no complete checkpoint there (no manifest, or files missing)")
    return manager.restore(manifest, dest), step


def model_description(checkpoint: Path, model: str | None, settings: Settings):
    """(config, tokenizer): the checkpoint's own ``model/``, else those of ``model`` (a model location)."""
    if (description := saved_description(checkpoint)) is not None:
        return description
    if model is None:
        raise CheckpointError("the checkpoint holds no model description (it predates them): name the model it "
                              "trained with --model (its spec.model.path)")
    skeleton, tokenizer, _ = load_skeleton(ModelSource(path=model), 0, settings)  # no weights read
    return skeleton.config, tokenizer


def upload(directory: Path, out_uri: str, step: int, settings: Settings, meta: dict[str, str]) -> str:
    """Every file of ``directory`` to ``out_uri``, then its manifest (sizes, SHA-256): complete only then."""
    store = open_store(out_uri, endpoint=settings.s3_endpoint)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = str(path.relative_to(directory))
        store.upload(path, name)
        files[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    store.write_text(MANIFEST, Manifest(step, files, meta).to_json())
    shutil.rmtree(directory, ignore_errors=True)
    return store.uri
