"""The checkpoint protocol: files first, manifest last, prune only behind a complete one.

Layout under the checkpoint URI::

    step-00000050/RUN                 the writing run's id, first (so a partial step has an owner too)
    step-00000050/<files…>            model/optimizer shards, trainer state — anything in the staging dir
    step-00000050/MANIFEST.json       {"step", "files": {name: {"size", "sha256"}}, "meta": {…}}

A checkpoint exists only once its manifest does, and the manifest is written after every file is
uploaded, so a writer killed mid-upload leaves a directory that ``latest()`` skips (with a warning
naming it). ``latest()`` also skips manifests that do not parse or whose files are missing or of
the wrong size; ``restore()`` verifies every SHA-256, and ``restore_newest()`` falls back to the
next older complete checkpoint when one fails that. ``keep = K`` (≥ 2, so there is always one to
fall back to) deletes older checkpoints (and abandoned partial ones) only after a newer one is
complete. A manifest records its run (``meta.run_id``, the experiment's UID): a run refuses to
load another run's checkpoints (``ForeignCheckpoint``), and prunes only its own (a step without a
run id, from before RUN markers, counts as anyone's): two runs on one URI never delete each other's.

Signed manifests: with a ``signing_key`` (the experiment's ``<name>-checkpoint-key`` Secret, given to
trainer pods as ``KUBERL_CHECKPOINT_KEY``; never in the bucket) every manifest carries
``signature`` = HMAC-SHA256(key, canonical JSON of step, files and meta), and a run resumes only from
a manifest whose signature verifies: write access to the bucket is no longer a way to hand the trainer
a file that torch unpickles (DCP's ``.metadata``), since every file's SHA-256 is in the signed
manifest and ``restore`` checks all of them before it returns (a local run's key: its work dir's
``checkpoint-key``). Without a key (reading another run's checkpoint for ``initFrom`` or ``kuberl
export``) nothing is signed or checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store import CheckpointError, Store, escapes

log = logging.getLogger("kuberl.checkpoint")
MANIFEST = "MANIFEST.json"
RUN = "RUN"


def step_dir(step: int) -> str:
    return f"step-{step:08d}/"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    signature: str | None = None

    def signed_bytes(self) -> bytes:
        """What the signature covers: step, files and meta as canonical JSON (sorted keys, no spaces)."""
        return json.dumps({"step": self.step, "files": self.files, "meta": self.meta}, sort_keys=True,
                          separators=(",", ":")).encode()

    def _mac(self, key: bytes) -> str:
        return hmac.new(key, self.signed_bytes(), hashlib.sha256).hexdigest()

    def sign(self, key: bytes) -> Manifest:
        return Manifest(self.step, self.files, self.meta, self._mac(key))

    def signed_by(self, key: bytes) -> bool:
        return isinstance(self.signature, str) and hmac.compare_digest(self._mac(key), self.signature)

    def to_json(self) -> str:
        signature = {"signature": self.signature} if self.signature else {}
        return json.dumps({"step": self.step, "files": self.files, "meta": self.meta, **signature,
                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2)


def safe_name(name: str) -> bool:
    """A manifest entry that stays inside its checkpoint directory (:func:`.store.escapes`), without a
    backslash."""
    return not escapes(name) and "\\" not in name


class ForeignCheckpoint(CheckpointError):
    """The checkpoint URI holds another run's checkpoints."""


class UntrustedCheckpoint(CheckpointError):
    """Checkpoints of this run whose manifests are not signed with its key."""


@dataclass
class CheckpointManager:
    store: Store
    keep: int = 3
    run_id: str | None = None  # written into each step (RUN, meta.run_id); None: a run without identity
    signing_key: bytes | None = None  # signs each manifest, and only manifests it signed are restored

    def save(self, staging: Path, step: int, meta: dict[str, Any] | None = None) -> str:
        """Upload every file under ``staging``, then the manifest, then prune. Returns the checkpoint's URI."""
        started = time.perf_counter()
        entries = self.upload_files(staging, step)
        return self.commit(step, entries, meta, time.perf_counter() - started)

    def upload_files(self, staging: Path, step: int) -> dict[str, dict[str, Any]]:
        """Upload the files under ``staging`` into the step's directory (no manifest yet); returns their
        manifest entries. Several writers (one per node) may each upload their own files."""
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        prefix = step_dir(step)
        if self.run_id:
            self.store.write_text(prefix + RUN, self.run_id)
        entries: dict[str, dict[str, Any]] = {}
        for path in files:
            name = path.relative_to(staging).as_posix()
            entries[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
            self.store.upload(path, prefix + name)
        return entries

    def commit(self, step: int, entries: dict[str, dict[str, Any]], meta: dict[str, Any] | None = None,
               seconds: float = 0.0) -> str:
        """Write the manifest (after every file of the step is uploaded), then prune; ``seconds``: how
        long the uploads took, for the log line."""
        if not entries:
            raise CheckpointError(f"checkpoint of step {step}: nothing was uploaded")
        prefix = step_dir(step)
        meta = {**(meta or {}), **({"run_id": self.run_id} if self.run_id else {})}
        manifest = Manifest(step, entries, meta)
        if self.signing_key:
            manifest = manifest.sign(self.signing_key)
        self.store.write_text(prefix + MANIFEST, manifest.to_json())
        size = sum(e["size"] for e in entries.values())
        log.info("checkpoint step %d: %d files, %.1f MiB in %.2fs → %s%s", step, len(entries), size / 2**20,
                 seconds, self.store.uri, prefix)
        self.prune()
        return self.store.uri + prefix

    def _steps(self) -> dict[int, dict[str, int]]:
        """Every step directory present, with its objects (name → size)."""
        out: dict[int, dict[str, int]] = {}
        for key, size in self.store.list().items():
            head, _, rest = key.partition("/")
            if head.startswith("step-") and head[5:].isdigit() and rest:
                out.setdefault(int(head[5:]), {})[rest] = size
        return out

    def _complete(self, step: int, objects: dict[str, int]) -> Manifest | None:
        where = self.store.uri + step_dir(step)
        if MANIFEST not in objects:
            log.warning("skipping checkpoint %s: no %s (incomplete upload)", where, MANIFEST)
            return None
        try:
            data = json.loads(self.store.read_text(step_dir(step) + MANIFEST) or "")
            manifest = Manifest(int(data["step"]), dict(data["files"]), dict(data.get("meta") or {}),
                                data.get("signature"))
        except (ValueError, KeyError, TypeError) as err:
            log.warning("skipping checkpoint %s: unreadable %s (%s)", where, MANIFEST, err)
            return None
        unsafe = [n for n in manifest.files if not safe_name(n)]
        if unsafe:
            log.warning("skipping checkpoint %s: %s names files outside its directory %s", where, MANIFEST, unsafe[:5])
            return None
        bad = [n for n, e in manifest.files.items() if objects.get(n) != e.get("size")]
        if manifest.step != step or bad:
            log.warning("skipping checkpoint %s: missing or truncated files %s", where, bad[:5])
            return None
        return manifest

    def complete(self) -> list[Manifest]:
        """Every complete checkpoint, newest first (incomplete or corrupt ones skipped, with a warning)."""
        steps = self._steps()
        manifests = (self._complete(step, steps[step]) for step in sorted(steps, reverse=True))
        return [m for m in manifests if m is not None]

    def latest(self) -> Manifest | None:
        """The newest complete checkpoint."""
        return next(iter(self.complete()), None)

    def restore_newest(self, dest_root: Path, run_id: str | None) -> Manifest | None:
        """Download and verify the newest complete checkpoint into ``dest_root/restore-<step>``; one
        that fails verification (or download) is skipped for the next older one. Raises
        ForeignCheckpoint if the newest is another run's, or names no run while this run has an id;
        UntrustedCheckpoint if none is signed with ``signing_key`` but some are not (never a silent
        start from scratch over them)."""
        untrusted: list[int] = []
        for manifest in self.complete():
            owner = manifest.meta.get("run_id")
            if run_id and owner != run_id:
                whose = f"belongs to run {owner}" if owner else "names no run (anyone could have written it)"
                raise ForeignCheckpoint(
                    f"{self.store.uri}{step_dir(manifest.step)} {whose}, not to this run ({run_id}): "
                    "refusing to resume from or prune another run's checkpoints; give this experiment its own "
                    "spec.checkpoint.uri (or delete the old checkpoints)")
            if not self.trusted(manifest):
                log.warning("checkpoint %s%s: %s is not signed with this experiment's key; skipped",
                            self.store.uri, step_dir(manifest.step), MANIFEST)
                untrusted.append(manifest.step)
                continue
            try:
                self.restore(manifest, dest_root / f"restore-{manifest.step}")
                return manifest
            except (CheckpointError, OSError) as err:
                log.warning("checkpoint %s%s failed verification (%s); falling back to the previous one",
                            self.store.uri, step_dir(manifest.step), err)
        if untrusted:
            raise UntrustedCheckpoint(
                f"{self.store.uri}: the checkpoints of steps {untrusted[:5]} are not signed with this experiment's "
                "key (its -checkpoint-key Secret): written by someone else, or before KubeRL signed manifests. "
                "Refusing to resume from them or to start over them; move them away to start afresh")
        return None

    def trusted(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` may be restored: signed with ``signing_key``, or no key to check."""
        return self.signing_key is None or manifest.signed_by(self.signing_key)

    def restore(self, manifest: Manifest, dest: Path) -> Path:
        """Download the checkpoint's files into ``dest`` and verify their SHA-256 (names that would land
        outside ``dest`` are refused before anything is written)."""
        if not self.trusted(manifest):
            raise UntrustedCheckpoint(f"{self.store.uri}{step_dir(manifest.step)}: {MANIFEST} is not signed with "
                                      "this experiment's key")
        if unsafe := [n for n in manifest.files if not safe_name(n)]:
            raise CheckpointError(f"{self.store.uri}{step_dir(manifest.step)}: {MANIFEST} names files outside its "
                                  f"directory: {unsafe[:5]}")
        for name, entry in manifest.files.items():
            local = dest / name
            self.store.download(step_dir(manifest.step) + name, local)
            if sha256(local) != entry["sha256"]:
                raise CheckpointError(f"{self.store.uri}{step_dir(manifest.step)}{name}: checksum mismatch")
        return dest

    def _owner(self, step: int, objects: dict[str, int], manifest: Manifest | None) -> str | None:
        """The run that wrote ``step``: its manifest's, else its RUN marker's; None when neither says."""
        if manifest is not None:
            return manifest.meta.get("run_id")
        text = self.store.read_text(step_dir(step) + RUN) if RUN in objects else None
        return text.strip() if text else None

    def prune(self) -> list[int]:
        """Keep this run's newest ``keep`` complete checkpoints; drop its older ones and its partial
        ones behind them (with their unfinished multipart uploads). Another run's steps are not touched."""
        steps = self._steps()
        manifests = {s: self._complete(s, objects) for s, objects in steps.items()}
        owners = {s: self._owner(s, steps[s], manifests[s]) for s in steps}
        mine = [s for s in steps if not self.run_id or owners[s] in (None, self.run_id)]
        complete = sorted((s for s in mine if manifests[s] is not None), reverse=True)
        if not complete:
            return []
        kept = set(complete[:self.keep])
        doomed = [s for s in mine if s not in kept and s < complete[0]]  # a partial one behind is abandoned
        for step in doomed:
            self.store.delete_prefix(step_dir(step))
        if doomed:
            log.info("pruned checkpoints %s (keep %d)", sorted(doomed), self.keep)
        return sorted(doomed)
