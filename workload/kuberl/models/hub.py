"""``hf://ORG/NAME[@REVISION]`` models from the Hugging Face hub (or a mirror, ``spec.storage.hubEndpoint``),
downloaded with ``huggingface_hub`` into the node-local cache (``<cache dir>/hub``), which every
process of a pod shares: the hub library's file locks let the ranks of a pod download once.

Only what ``from_pretrained`` reads is fetched (configs, safetensors, tokenizer files, templates),
not the ``.bin``/``.pth`` copies many repositories also hold. The snapshot's directory name is the
commit it resolved to: the run records it (summary ``model.revision``, ``status.progress``), so a
run is reproducible even from a branch name.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..api.spec import HUB_PREFIX
from ..settings import Settings, hub_token

WANTED = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]
_HUB_PATH = re.compile(r"^hf://(?P<repo>[^@/]+/[^@/]+)(@(?P<revision>.+))?$")


class HubError(ValueError):
    """An hf:// location cannot be fetched; the message names the field and the repository."""


@dataclass(frozen=True)
class HubModel:
    repo: str
    revision: str | None  # as the spec gives it (None: the default branch)


def parse_hub_path(uri: str) -> HubModel | None:
    """``hf://ORG/NAME[@REVISION]`` → its parts; None for any other location."""
    if not uri.startswith(HUB_PREFIX):
        return None
    match = _HUB_PATH.match(uri)
    if match is None:
        raise HubError(f"{uri!r}: write a hub model as hf://ORG/NAME or hf://ORG/NAME@REVISION")
    return HubModel(match["repo"], match["revision"])


def snapshot(uri: str, field: str, settings: Settings) -> Path:
    """The local directory of the hub model ``uri`` (downloaded once per node; its name is the commit)."""
    from huggingface_hub import snapshot_download

    return _fetched(uri, field, lambda model: Path(snapshot_download(
        model.repo, revision=model.revision, cache_dir=settings.cache_dir / "hub", allow_patterns=WANTED,
        token=hub_token(settings), endpoint=settings.hub_endpoint)))


def config_file(uri: str, field: str, settings: Settings) -> Path:
    """The ``config.json`` of the hub model ``uri``, and nothing else of it (``kuberl validate``'s model
    checks): the cached one, else fetched — after one metadata request without retries, so that a hub
    out of reach fails at once (``hf_hub_download`` retries for ≈ 20 s before it gives up)."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fetch(model: HubModel) -> Path:
        where = {"revision": model.revision, "cache_dir": settings.cache_dir / "hub"}
        token = hub_token(settings)
        with contextlib.suppress(LocalEntryNotFoundError):
            return Path(hf_hub_download(model.repo, "config.json", local_files_only=True, **where))
        try:
            get_hf_file_metadata(hf_hub_url(model.repo, "config.json", revision=model.revision,
                                            endpoint=settings.hub_endpoint), token=token)
        except (httpx2.ConnectError, httpx2.TimeoutException) as err:  # what hf_hub_download would retry
            raise OSError(f"the hub at {settings.hub_endpoint or 'huggingface.co'} is out of reach: {err}") from err
        return Path(hf_hub_download(model.repo, "config.json", token=token, endpoint=settings.hub_endpoint, **where))

    return _fetched(uri, field, fetch)


def _fetched(uri: str, field: str, fetch: Callable[[HubModel], Path]) -> Path:
    """``fetch`` of the hub model ``uri``; its failures as HubError naming ``field`` and the repository."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    model = parse_hub_path(uri)
    assert model is not None
    try:
        return fetch(model)
    except RepositoryNotFoundError as err:
        raise HubError(f"{field} {uri!r}: no such repository, or it is gated/private and the token "
                       "(spec.storage.hubTokenSecret) does not grant it") from err
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise HubError(f"{field} {uri!r}: {type(err).__name__}: {err}") from err


def resolved_revision(directory: Path) -> str | None:
    """The commit a hub snapshot directory holds (its name), or None for any other directory."""
    return directory.name if directory.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", directory.name) \
        else None
