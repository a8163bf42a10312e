"""``s3://`` models and datasets, downloaded once into a node-local cache.

``local_copy(uri)`` returns a local path for an ``s3://bucket/prefix/`` (every object under it, e.g.
a Hugging Face model directory: config, safetensors shards, tokenizer files) or an
``s3://bucket/key`` (one object, e.g. a JSONL dataset). Layout of the cache
(``settings.cache_dir``: ``$KUBERL_CACHE_DIR``, default ``/tmp/kuberl-cache``)::

    s3/<bucket>/<prefix or key>           the files
    s3/<bucket>/<prefix or key>.kuberl-complete.json   written last: key → [size, etag]

Processes that share the cache (the ranks of a pod, or pods of a node that mount one cache
volume) take an exclusive file lock per URI, so exactly one downloads while the others wait and
then reuse it. A download is verified (size; MD5 where the ETag is one, i.e. not multipart) and
renamed into place file by file; the completion record is written last, so an interrupted
download is redone, and so is one whose objects changed in the bucket. Object keys that would
escape the cache directory (``..``, absolute) are refused.

Credentials come from the standard AWS chain (in a pod: env filled from the experiment's
``credentialsSecret``); ``settings.s3_endpoint`` points at an S3-compatible store.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from .checkpoint.store import CheckpointError, S3Store, escapes
from .settings import Settings

log = logging.getLogger("kuberl.remote")

COMPLETE_SUFFIX = ".kuberl-complete.json"


class RemoteError(RuntimeError):
    """An s3:// source could not be listed, downloaded or verified; the message names the URI."""


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` → (bucket, "some/key")."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise RemoteError(f"{uri!r} is not an s3://bucket/key URI")
    return parsed.netloc, parsed.path.lstrip("/")


def safe_relative(key: str, prefix: str) -> PurePosixPath:
    """The path of ``key`` below ``prefix``; refuses keys that would leave the cache directory."""
    rel = key[len(prefix):]
    if escapes(rel):
        raise RemoteError(f"object key {key!r} cannot be stored below {prefix!r}")
    return PurePosixPath(rel)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Held by one process of the node at a time (an flock on ``lock_path``)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, size: int, etag: str, uri: str) -> None:
    actual = path.stat().st_size
    if actual != size:
        raise RemoteError(f"{uri}: downloaded {actual} bytes, the store lists {size}")
    if etag and "-" not in etag and _md5(path) != etag:  # single-part uploads: the ETag is the MD5
        raise RemoteError(f"{uri}: content does not match the store's checksum (ETag {etag})")


def local_copy(uri: str, settings: Settings, store: S3Store | None = None) -> Path:
    """The local path of ``uri`` (a prefix ending in ``/`` → a directory; otherwise one file),
    downloading it first unless a verified copy is already in the cache (``settings.cache_dir``)."""
    try:
        return _local_copy(uri, settings, store)
    except CheckpointError as err:  # the store's own error names the URI and the cause
        raise RemoteError(str(err)) from err


def _local_copy(uri: str, settings: Settings, store: S3Store | None) -> Path:
    bucket, key = split_s3(uri)
    is_prefix = key == "" or key.endswith("/")
    target = settings.cache_dir / "s3" / bucket / key
    stem = str(target).rstrip("/")  # the record and the lock sit beside the file or directory
    record = Path(stem + COMPLETE_SUFFIX)
    store = store or S3Store(bucket, "", endpoint=settings.s3_endpoint)
    with exclusive(Path(stem + ".lock")):
        listing = {k: list(info) for k, info in store.list_objects(key).items() if is_prefix or k == key}
        if not listing:
            raise RemoteError(f"{uri}: no such object{'s under this prefix' if is_prefix else ''} in the store")
        if record.is_file() and json.loads(record.read_text()) == listing:
            return target
        record.unlink(missing_ok=True)
        start, total = time.perf_counter(), sum(size for size, _ in listing.values())
        log.info("downloading %s: %d object(s), %.1f MB", uri, len(listing), total / 1e6)
        for object_key, (size, etag) in sorted(listing.items()):
            path = target / safe_relative(object_key, key) if is_prefix else target
            partial = path.with_name(path.name + ".partial")
            store.download(object_key, partial)
            _verify(partial, size, etag, f"s3://{bucket}/{object_key}")
            os.replace(partial, path)
        record.write_text(json.dumps(listing))
        log.info("downloaded %s in %.1f s", uri, time.perf_counter() - start)
    return target
