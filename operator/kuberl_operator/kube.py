"""The operator's only door to the Kubernetes API: a tiny async REST client over any kind.

Manifests are plain dicts, so one client serves Pods, Services, ConfigMaps, our custom resources,
PodGroups and PyTorchJobs alike. It speaks HTTP with aiohttp on the operator's event loop (kopf's
own client does too: no thread per call), authenticated as kopf is — the same login functions, the
service account in a pod, else $KUBECONFIG — and logs in again when the server answers 401 (a
rotated service-account token). ``max_in_flight`` requests at most at once, each after its turn in
the rate limit (``ratelimit``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import kopf

from .ratelimit import RateLimit
from .settings import DEFAULT_MAX_IN_FLIGHT

log = logging.getLogger("kuberl.operator")

Manifest = dict[str, Any]
Credentials = Callable[[], kopf.ConnectionInfo]

PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Node": "nodes",
    "Namespace": "namespaces",
    "RLExperiment": "rlexperiments",
    "InferencePool": "inferencepools",
    "TrainerJob": "trainerjobs",
    "PodGroup": "podgroups",
    "PyTorchJob": "pytorchjobs",
    "TrainJob": "trainjobs",
    "Deployment": "deployments",
    "Event": "events",
}
CLUSTER_SCOPED = {"Node", "Namespace"}
LIST_PAGE = 500  # objects per list request at most (the API server's chunking; kubectl asks for 500 too)
FIRST_PAGE = 4  # objects in a list's first page, before their size is known
PAGE_BYTES = 4 << 20  # a list page's answer, about: the next page asks for as many objects as fit
WATCH_GRACE_SECONDS = 30  # a watch with no byte for its timeoutSeconds and this long is dead: reconnect


class ApiError(Exception):
    """A request the API server refused: its HTTP ``status``, ``reason`` and body (a Status, whose
    ``message`` says why), and its headers (Retry-After)."""

    def __init__(self, status: int, reason: str, body: str = "", headers: Mapping[str, str] | None = None):
        super().__init__(f"({status}) {reason}")
        self.status, self.reason, self.body, self.headers = status, reason, body, dict(headers or {})


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Credentials as kopf's login handler finds them: the pod's service account, else $KUBECONFIG
    (read now, so a rotated token or a changed file is seen)."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise RuntimeError("no Kubernetes credentials: neither a service account nor $KUBECONFIG")
    return info


def next_page_size(answer_bytes: int, items: int, budget: int = PAGE_BYTES) -> int:
    """Objects to ask for in the next list page: as many as ``budget`` bytes hold at this page's mean
    size (``answer_bytes / items``), between 1 and ``LIST_PAGE``. Another tenant's 1 MiB look-alikes
    come 4 at a time, a namespace of small pods 500 at a time."""
    if items == 0:
        return LIST_PAGE
    return max(1, min(LIST_PAGE, budget * items // max(1, answer_bytes)))


def watch_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a watch stream (one JSON event each), however the bytes were cut, with no limit
    on a line's length (aiohttp's ``readline`` refuses lines over 128 KiB; an object may be 1.5 MiB)."""

    async def lines() -> AsyncIterator[bytes]:
        pending = b""
        async for chunk in chunks:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                if line.strip():
                    yield line
        if pending.strip():
            yield pending

    return lines()


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """REST path of a collection (``name`` None) or of one object."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = "" if kind in CLUSTER_SCOPED or namespace is None else f"/namespaces/{namespace}"
    path = f"{prefix}{ns}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class Kube:
    """Create / get / list / patch / delete plain-dict objects. 404 on get is ``None``."""

    def __init__(self, credentials: Credentials, timeout: float = 30.0, limit: RateLimit | None = None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        self._credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout)  # a hung call fails, and the sync is retried
        self._limit = limit  # every call waits its turn (``ratelimit``); None: no client-side limit
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._max_in_flight = max_in_flight
        self._session: aiohttp.ClientSession | None = None
        self._streams: aiohttp.ClientSession | None = None  # watches: long-lived, outside max_in_flight
        self._server = ""

    def connect(self) -> aiohttp.ClientSession:
        """Log in and open the session (the first call does, if nothing did before; a 401 again)."""
        info = self._credentials()
        self._server = info.server.rstrip("/")
        ssl = info.as_ssl_context()
        common = {"headers": info.as_http_headers(), "proxy": info.proxy_url, "trust_env": info.trust_env}
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._max_in_flight, ssl=ssl),
                                              timeout=self._timeout, **common)
        self._streams = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl),
                                              timeout=aiohttp.ClientTimeout(total=None), **common)
        log.info("API client logged in to %s", self._server)
        return self._session

    async def close(self) -> None:
        for session in (self._session, self._streams):
            if session is not None:
                await session.close()
        self._session = self._streams = None

    async def _call(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                    content_type: str = "application/json") -> Any:
        answer = await self._send(method, path, body, query, content_type)
        return json.loads(answer) if answer else None

    async def _send(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                    content_type: str = "application/json") -> bytes:
        """One request, its answer's bytes (an error status raises ``ApiError``)."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        data = json.dumps(body) if body is not None else None
        async with self._in_flight:
            for attempt in (1, 2):
                if self._limit is not None:
                    await self._limit.acquire()
                session = self._session or self.connect()
                async with session.request(method, self._server + path, params=query, data=data,
                                           headers=headers) as response:
                    if response.status == 401 and attempt == 1:  # a rotated token: log in again, once
                        await self.close()
                        continue
                    answer = await response.read()
                    if response.status >= 400:
                        raise ApiError(response.status, response.reason or "", answer.decode(errors="replace"),
                                       response.headers)
                    return answer
        raise AssertionError("unreachable")

    async def pod_log(self, namespace: str | None, pod: str, container: str, tail_lines: int, limit_bytes: int,
                      previous: bool = False) -> str:
        """A container's last ``tail_lines`` lines, at most ``limit_bytes`` (``previous``: of the container
        before its last restart), from the API server (``pods/log``)."""
        query = {"container": container, "tailLines": str(tail_lines), "limitBytes": str(limit_bytes),
                 **({"previous": "true"} if previous else {})}
        path = f"{resource_path('v1', 'Pod', namespace, pod)}/log"
        return (await self._send("GET", path, query=query)).decode(errors="replace")

    async def create(self, obj: Manifest) -> Manifest:
        meta = obj["metadata"]
        return await self._call("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        try:
            return await self._call("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def read(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        """``get`` from the API server itself (a cache in front of ``get`` does not answer this, and what
        it returns is not cached: it may be someone else's object, outside what the watches deliver)."""
        return await Kube.get(self, api_version, kind, namespace, name)

    async def read_list(self, api_version: str, kind: str, namespace: str | None,
                        selector: dict[str, str]) -> list[Manifest]:
        """``list`` from the API server itself (as ``read``)."""
        return await Kube.list(self, api_version, kind, namespace, selector)

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: dict[str, str]) -> list[Manifest]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        return (await self._call("GET", resource_path(api_version, kind, namespace), query=query)).get("items", [])

    async def list_pages(self, api_version: str, kind: str, namespace: str | None, label_selector: str | None,
                         budget: int = PAGE_BYTES) -> AsyncIterator[tuple[list[Manifest], str]]:
        """Every object of ``kind`` in ``namespace`` (None: all) that ``label_selector`` selects, a page
        at a time (``limit``/``continue``: one page in memory at once, of about ``budget`` bytes:
        ``next_page_size``), each with its ``apiVersion`` and ``kind`` (a list's items lack them);
        with each page, the list's resourceVersion (where a watch of what follows starts)."""
        query = {"limit": str(FIRST_PAGE), **({"labelSelector": label_selector} if label_selector else {})}
        while True:
            raw = await self._send("GET", resource_path(api_version, kind, namespace), query=query)
            answer = json.loads(raw)
            items, meta = answer.get("items") or [], answer.get("metadata") or {}
            query["limit"] = str(next_page_size(len(raw), len(items), budget))
            del raw, answer
            yield [{"apiVersion": api_version, "kind": kind, **item} for item in items], meta.get("resourceVersion", "")
            if not meta.get("continue"):
                return
            query["continue"] = meta["continue"]

    async def watch(self, api_version: str, kind: str, namespace: str | None, label_selector: str | None,
                    since: str, timeout_seconds: int) -> AsyncIterator[Manifest]:
        """The watch events (``{"type", "object"}``) of ``kind`` in ``namespace`` (None: all) after
        resourceVersion ``since``, until the server ends the stream (``timeout_seconds``) — on a
        session of its own (a watch is open for minutes: it takes none of ``max_in_flight``), each
        object with its ``apiVersion`` and ``kind``. An error status raises ``ApiError`` (a 410 Gone
        says ``since`` is too old: list again); a 401 logs in again for the next call."""
        query = {"watch": "true", "allowWatchBookmarks": "true", "resourceVersion": since,
                 "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            query["labelSelector"] = label_selector
        if self._limit is not None:
            await self._limit.acquire()
        if self._streams is None:
            self.connect()
        assert self._streams is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + WATCH_GRACE_SECONDS)
        async with self._streams.get(self._server + resource_path(api_version, kind, namespace), params=query,
                                     headers={"Accept": "application/json"}, timeout=timeout) as response:
            if response.status >= 400:
                text = await response.text()
                if response.status == 401:
                    await self.close()
                raise ApiError(response.status, response.reason or "", text, response.headers)
            async for line in watch_lines(response.content.iter_any()):
                event = json.loads(line)
                if isinstance(event.get("object"), dict) and event.get("type") != "ERROR":
                    event["object"] = {"apiVersion": api_version, "kind": kind, **event["object"]}
                yield event

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: Manifest,
                    subresource: str | None = None) -> Manifest:
        path = resource_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self._call("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     foreground: bool = False) -> bool:
        """Delete with background propagation (``foreground``: the object stays, terminating, until the
        garbage collector has deleted what it owns, transitively); False if it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1",
                "propagationPolicy": "Foreground" if foreground else "Background"}
        try:
            await self._call("DELETE", resource_path(api_version, kind, namespace, name), body)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise
