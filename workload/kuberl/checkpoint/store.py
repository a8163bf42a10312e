"""Where checkpoints live: ``file://`` directories and ``s3://`` prefixes behind one small interface.

Keys are ``/``-separated paths relative to the checkpoint URI. S3 goes through boto3 (multipart
uploads above 8 MiB, retries with backoff in botocore's ``standard`` mode); credentials come only
from the standard AWS chain (in a pod: the environment filled from ``checkpoint.credentialsSecret``)
and are never logged. ``endpoint`` (``KUBERL_S3_ENDPOINT`` in a pod: ``kuberl.settings``) points at an
S3-compatible endpoint (MinIO, Ceph, tests); without one, boto3's own (``AWS_ENDPOINT_URL_S3``, else AWS).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol
from urllib.parse import urlparse


def escapes(name: str) -> bool:
    """Whether ``name``, joined onto a directory, would land outside it: absolute, empty, or climbing
    out through ``..`` (store keys written by anyone with access to the store)."""
    path = PurePosixPath(name)
    return path.is_absolute() or not path.parts or ".." in path.parts

class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the URI and the cause."""


class Store(Protocol):
    uri: str

    def upload(self, local: Path, key: str) -> None: ...

    def download(self, key: str, local: Path) -> None: ...

    def write_text(self, key: str, text: str) -> None: ...

    def read_text(self, key: str) -> str | None: ...

    def list(self, prefix: str = "") -> dict[str, int]:
        """Keys under ``prefix`` with their sizes in bytes."""
        ...

    def delete_prefix(self, prefix: str) -> None: ...


@dataclass
class LocalStore:
    root: Path

    @property
    def uri(self) -> str:
        return f"file://{self.root}/"

    def upload(self, local: Path, key: str) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        shutil.copyfile(local, tmp)
        os.replace(tmp, target)

    def download(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.root / key, local)

    def write_text(self, key: str, text: str) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        tmp.write_text(text)
        os.replace(tmp, target)  # atomic: a reader sees the old file or the whole new one

    def read_text(self, key: str) -> str | None:
        path = self.root / key
        return path.read_text() if path.is_file() else None

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return {}
        return {p.relative_to(self.root).as_posix(): p.stat().st_size for p in base.rglob("*")
                if p.is_file() and not p.name.endswith(".partial")}

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix, ignore_errors=True)


@dataclass
class S3Store:
    bucket: str
    prefix: str
    max_attempts: int = 8
    client: Any = field(default=None, repr=False)
    endpoint: str | None = None  # an S3-compatible endpoint (settings.s3_endpoint); None: boto3's own chain

    def __post_init__(self) -> None:
        if self.client is None:
            import boto3
            from botocore.config import Config

            self.client = boto3.client(
                "s3", endpoint_url=self.endpoint or None,
                config=Config(retries={"max_attempts": self.max_attempts, "mode": "standard"},
                              connect_timeout=5, read_timeout=60),
            )

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (BotoCoreError, ClientError) as err:  # credentials never appear in these messages
            raise CheckpointError(f"{what} {self.uri}: {err}") from err

    def upload(self, local: Path, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
        self._call("upload to", self.client.upload_file, str(local), self.bucket, self._key(key), Config=config)

    def download(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self._call("download from", self.client.download_file, self.bucket, self._key(key), str(local))

    def write_text(self, key: str, text: str) -> None:
        self._call("write to", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=text.encode())

    def read_text(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise CheckpointError(f"read from {self.uri}: {err}") from err
        return body.decode()

    def list(self, prefix: str = "") -> dict[str, int]:
        return {key: size for key, (size, _) in self.list_objects(prefix).items()}

    def list_objects(self, prefix: str = "") -> dict[str, tuple[int, str]]:
        """Keys under ``prefix`` with their size and ETag (unquoted; the MD5 of single-part uploads)."""
        paginator = self.client.get_paginator("list_objects_v2")
        out: dict[str, tuple[int, str]] = {}
        pages = self._call("list", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))))
        for page in pages:
            for item in page.get("Contents", []):
                out[item["Key"][len(self.prefix):]] = (item["Size"], str(item.get("ETag", "")).strip('"'))
        return out

    def delete_prefix(self, prefix: str) -> None:
        """Delete the objects under ``prefix`` and abort its unfinished multipart uploads (a writer
        killed mid-upload leaves parts that are billed but never listed as objects)."""
        keys = [{"Key": self._key(k)} for k in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            self._call("delete from", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": keys[i:i + 1000]})
        for upload in self.multipart_uploads(prefix):
            self._call("abort an upload in", self.client.abort_multipart_upload, Bucket=self.bucket,
                       Key=upload["Key"], UploadId=upload["UploadId"])

    def multipart_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Unfinished multipart uploads under ``prefix`` (Key, UploadId, …)."""
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = self._call("list uploads in", lambda: list(paginator.paginate(Bucket=self.bucket,
                                                                              Prefix=self._key(prefix))))
        return [u for page in pages for u in page.get("Uploads", [])]


def open_store(uri: str, **s3_options: Any) -> Store:
    """``file:///abs/dir/`` or ``s3://bucket/prefix/`` (``spec.checkpoint.uri``)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return LocalStore(Path(parsed.path))
    if parsed.scheme == "s3" and parsed.netloc:
        prefix = parsed.path.lstrip("/")
        return S3Store(parsed.netloc, prefix if not prefix or prefix.endswith("/") else prefix + "/", **s3_options)
    raise CheckpointError(f"spec.checkpoint.uri {uri!r}: expected s3://bucket/prefix/ or file:///path/")
