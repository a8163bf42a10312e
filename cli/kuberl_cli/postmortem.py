"""``kuberl postmortem NAME``: a failed experiment's post-mortem bundle, from the ConfigMap the operator kept
it in (``status.postmortem``, ``kuberl_operator.postmortem``), to a local file and — with the reader's own
storage credentials, which the operator never holds — beside the checkpoints:
``<spec.checkpoint.uri>postmortem/<time>/postmortem.tar.gz`` (``--to checkpoint``) or any store URI.

Read through ``kubectl proxy`` (``--api``), as ``kuberl top`` reads: the user's kubeconfig and rights."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

from kuberl.api.contract import POSTMORTEM_ARCHIVE_KEY
from kuberl.checkpoint import open_store
from kuberl.settings import Settings

from .fetch import config_map_url, experiment_url, read_object

TIMEOUT_SECONDS = 30


def fetch(api: str, namespace: str, name: str) -> tuple[bytes, dict[str, Any], str | None]:
    """(the archive, ``status.postmortem``, ``spec.checkpoint.uri``) of the experiment; a ValueError says
    why there is none (the experiment has not failed, or the operator could not keep one)."""
    experiment = read_object(experiment_url(api, namespace, name), TIMEOUT_SECONDS)
    status = experiment.get("status") or {}
    kept = status.get("postmortem") or {}
    if not kept.get("configMap"):
        why = kept.get("error") or f"its phase is {status.get('phase') or 'not set'}; one is kept when it fails"
        raise ValueError(f"RLExperiment {namespace}/{name} has no post-mortem: {why}")
    config = read_object(config_map_url(api, namespace, kept["configMap"]), TIMEOUT_SECONDS)
    data = base64.b64decode((config.get("binaryData") or {}).get(POSTMORTEM_ARCHIVE_KEY, ""))
    if not data:
        raise ValueError(f"ConfigMap {namespace}/{kept['configMap']} holds no {POSTMORTEM_ARCHIVE_KEY}")
    checkpoint = ((experiment.get("spec") or {}).get("checkpoint") or {}).get("uri")
    return data, kept, checkpoint


def store_key(kept: dict[str, Any]) -> str:
    """Where under a store's URI the bundle goes: ``postmortem/<time>/postmortem.tar.gz`` (the time as
    ``20261129T120000Z``: no colons in a key)."""
    stamp = str(kept.get("time") or "unknown").replace("-", "").replace(":", "")
    return f"postmortem/{stamp}/{POSTMORTEM_ARCHIVE_KEY}"


def keep(data: bytes, kept: dict[str, Any], out: Path, to: str | None, checkpoint: str | None,
         settings: Settings) -> list[str]:
    """Write the bundle to ``out`` and, with ``to`` (a store URI, or ``checkpoint``: the experiment's
    ``spec.checkpoint.uri``), upload it there; where it went."""
    out.write_bytes(data)
    places = [str(out)]
    if to is None:
        return places
    if to == "checkpoint":
        if not checkpoint:
            raise ValueError("--to checkpoint: the experiment has no spec.checkpoint.uri; give a store URI")
        to = checkpoint
    store = open_store(to if to.endswith("/") else to + "/", endpoint=settings.s3_endpoint)
    key = store_key(kept)
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / POSTMORTEM_ARCHIVE_KEY
        staged.write_bytes(data)
        store.upload(staged, key)
    return [*places, f"{store.uri}{key}"]
