"""A Hugging Face hub on loopback, as moto stands in for S3: the routes ``huggingface_hub``'s
``snapshot_download`` calls (repository info at a revision, the file tree, file downloads), serving
model repositories from local directories, with an optional token that gated repositories require.
It records every path asked for, so a test can see what was (not) downloaded."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from .loopback import serve_in_thread

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the one commit of every repository here


@dataclass
class Repo:
    directory: Path
    token: str | None = None  # gated: requests without "Bearer <token>" get 401
    kind: str = "models"  # or "datasets"

    def files(self) -> dict[str, Path]:
        return {str(p.relative_to(self.directory)): p for p in sorted(self.directory.rglob("*")) if p.is_file()}


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requested: list[str] = field(default_factory=list)
    authorizations: list[str] = field(default_factory=list)  # every Authorization header received
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/{kind}/{org}/{name}", self.info)
        app.router.add_get("/api/{kind}/{org}/{name}/revision/{revision:.+}", self.info)
        app.router.add_get("/api/{kind}/{org}/{name}/tree/{revision}", self.tree)
        app.router.add_get("/api/{kind}/{org}/{name}/tree/{revision}/{path:.+}", self.tree)
        app.router.add_route("*", "/datasets/{org}/{name}/resolve/{revision}/{path:.+}", self.resolve)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{path:.+}", self.resolve)
        return app

    def _repo(self, request: web.Request) -> Repo:
        with self._lock:
            self.requested.append(request.path)
            if "Authorization" in request.headers:
                self.authorizations.append(request.headers["Authorization"])
        repo = self.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
        kind = request.match_info.get("kind") or ("datasets" if request.path.startswith("/datasets/") else "models")
        if repo is None or repo.kind != kind:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text='{"error": "Repository not found"}')
        if repo.token is not None and request.headers.get("Authorization") != f"Bearer {repo.token}":
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "GatedRepo"}, text='{"error": "gated"}')
        if request.match_info.get("revision", "main") not in ("main", COMMIT):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text='{"error": "no revision"}')
        return repo

    async def info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        return web.json_response({"id": f"{request.match_info['org']}/{request.match_info['name']}", "sha": COMMIT,
                                  "siblings": [{"rfilename": name} for name in repo.files()], "private": False})

    async def tree(self, request: web.Request) -> web.Response:
        """The files under ``path`` (all with ``recursive``), and the folders directly under it."""
        repo, under = self._repo(request), request.match_info.get("path", "").strip("/")
        recursive = request.query.get("recursive", "false").lower() == "true"
        prefix = f"{under}/" if under else ""
        entries, folders = [], set()
        for name, path in repo.files().items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "path": name, "size": path.stat().st_size, "oid": _oid(path)})
        entries += [{"type": "directory", "path": folder, "oid": "0" * 40} for folder in sorted(folders)]
        return web.json_response(entries)

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        path = repo.files().get(request.match_info["path"])
        if path is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"}, text='{"error": "no such file"}')
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(path)}"', "Content-Length": str(path.stat().st_size)}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=path.read_bytes(), headers=headers)


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def start(hub: FakeHub, port: int):
    """Serve ``hub`` on 127.0.0.1:``port`` in a thread; returns the stop function."""
    return serve_in_thread(hub.app(), port)
