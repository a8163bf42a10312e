"""The children's watches, the operator's own: list, then watch, one object at a time, in pages
bounded by bytes (client-go's reflector is the model).

kopf watches the custom resources. The children's kinds (pods, ConfigMaps, Services, ...) are
selected by labels anyone can put on their own objects (``watches``), so in cluster-wide mode another
tenant decides how much arrives. kopf lists a kind whole (or in pages of a fixed count) and gives
every object a task of its own that holds the body until its handler has run: 5,000 look-alike pods
of 200 KiB and 600 ConfigMaps of 1 MiB took the operator to 3.8 GiB
(``benchmarks/operator_neighbours.py --hostile``). Here each kind, in each watched namespace (or the
whole cluster), is one task (``Informer.run``) that

1. lists in pages of about ``kube.PAGE_BYTES`` (``Kube.list_pages``), handing each object to
   ``handle`` before the next page is read, then hands over as deleted every object held of that
   kind there (``Held``) that the list no longer has and that is not newer than the list (it went
   while no watch was open; an object the operator wrote after the list began is not);
2. watches from the list's resourceVersion until the server ends the stream after ``resync``
   seconds, handling each event before the next is parsed;
3. lists again: when the watch ends (every resync, so each object is delivered again — the safety
   net of a level-triggered operator), when the server says the version is gone (410), or after an
   error (after a backoff).

At most one page, or one event, of another tenant's objects is in memory at a time. A kind the
cluster does not serve to the operator (no CRD — Kubeflow not installed — or no RBAC: 403/404) is
tried again every resync: installing the CRD later needs no restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from .cache import Key, object_key
from .kube import ApiError, Kube, Manifest
from .retry import classify, reraise_if_cancelled
from .watches import Watched

log = logging.getLogger("kuberl.operator")

Handle = Callable[[Manifest, bool], Awaitable[None]]  # (object, live): False for a deletion
Held = Callable[[str, str | None], Iterable[Manifest]]  # (kind, namespace or None: all): the cache's objects
ERROR_BACKOFF_SECONDS = (1, 2, 5, 10)  # after the n-th failure in a row: the last one from then on
GONE = 410
NOT_SERVED = (403, 404)


def _version(obj: Manifest) -> int | None:
    value = obj["metadata"].get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


def vanished(held: Iterable[Manifest], listed: set[Key], list_version: str) -> list[Manifest]:
    """What a list at ``list_version`` says is gone: each held object not ``listed`` whose own
    resourceVersion is not newer than the list's (a newer one was written after the list began).
    Versions compared as numbers; where either is not a number, nothing is gone (the API calls them
    opaque; every API server in use counts)."""
    if not list_version.isdigit():
        return []
    at = int(list_version)
    return [obj for obj in held
            if object_key(obj) not in listed and (v := _version(obj)) is not None and v <= at]


@dataclass
class Informer:
    """One kind in one namespace (None: the whole cluster): ``run`` lists and watches it until
    cancelled. ``listed`` is set once its first list has ended, well or not (the start-up handler
    waits for it: the first sync sees every child that existed)."""

    kube: Kube
    watched: Watched
    namespace: str | None
    handle: Handle
    held: Held
    resync: int
    listed: asyncio.Event = field(default_factory=asyncio.Event)
    lists: int = 0  # done, for tests and logs

    @property
    def where(self) -> str:
        return f"in {self.namespace}" if self.namespace else "cluster-wide"

    async def run(self) -> None:
        failures, not_served = 0, False
        while True:
            try:
                version = await self._list()
                self.listed.set()
                failures, not_served = 0, False
                await self._watch(version)
            except ApiError as err:
                reraise_if_cancelled(err)
                self.listed.set()
                if err.status == GONE:
                    continue
                if err.status in NOT_SERVED:
                    if not not_served:
                        log.warning("%s %s: not served to the operator (%s); trying again every %ds", self.watched.kind,
                                    self.where, classify(err).message, self.resync)
                    not_served = True
                    await asyncio.sleep(self.resync)
                    continue
                failures = await self._back_off(err, failures)
            except Exception as err:  # a watch never ends: any failure is logged, then a new list
                reraise_if_cancelled(err)
                self.listed.set()
                failures = await self._back_off(err, failures)

    async def _back_off(self, err: Exception, failures: int) -> int:
        delay = ERROR_BACKOFF_SECONDS[min(failures, len(ERROR_BACKOFF_SECONDS) - 1)]
        failure = classify(err)
        log.warning("%s %s: watch failed (%s); listing again in %ds", self.watched.kind, self.where,
                    failure.message, delay, exc_info=failure.reason == "InternalError")
        await asyncio.sleep(delay)
        return failures + 1

    async def _list(self) -> str:
        """Every selected object handed over, a page at a time; then what vanished. The list's version."""
        listed: set[Key] = set()
        version = ""
        w = self.watched
        async for page, page_version in self.kube.list_pages(w.api_version, w.kind, self.namespace, w.selector):
            version = version or page_version  # the first page's: the snapshot every page continues
            for obj in page:
                listed.add(object_key(obj))
                await self.handle(obj, True)
            del page
        for obj in vanished(self.held(w.kind, self.namespace), listed, version):
            await self.handle(obj, False)
        self.lists += 1
        return version

    async def _watch(self, since: str) -> None:
        """Events after ``since`` until the server ends the stream (then the caller lists again)."""
        w = self.watched
        async for event in self.kube.watch(w.api_version, w.kind, self.namespace, w.selector, since, self.resync):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(int(obj.get("code") or 500), str(obj.get("reason") or "WatchError"),
                               str(obj.get("message") or ""))
            if kind in ("ADDED", "MODIFIED", "DELETED") and "metadata" in obj:
                await self.handle(obj, kind != "DELETED")
            del event, obj
