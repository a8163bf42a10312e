"""The cache filled before the first sync (controller-runtime's WaitForCacheSync).

kopf lists and watches each kind on its own and hands every object to its handlers as it arrives:
after a restart, a pool's sync could run before its pods' list came in, find none, create them again
(409) and write a status of 0 ready pods — every experiment flapping Running → Initializing → Running
(``benchmarks/operator_scale.py``, restart phase). kopf's own barrier (an ``@kopf.index`` on every
kind: no handler runs until all are listed) costs O(objects²) — 19 s of CPU to restart beside 300
experiments. So the start-up handler lists every watched kind itself first (``prime``): the first
sync finds every child that existed.

An object deleted between that list and kopf's own would stay held (no watch ever reports it):
``confirm`` lists once more, later, the kinds with objects no watch has delivered since
(``ObjectCache.unconfirmed``), forgets those the API server no longer has, and returns them so their
owners re-sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from .cache import Key, ObjectCache, object_key
from .kube import ApiError, Kube, Manifest
from .watches import WATCHED, Watched

NOT_SERVED = (403, 404)  # a kind the cluster does not have (no CRD) or the operator may not list: kopf warns


class NotServed(Exception):
    """No CRD for the kind, or no RBAC to list it (kopf warns once and does not watch it either)."""


async def _pages(kube: Kube, watched: Watched, namespaces: Sequence[str | None]) -> AsyncIterator[list[Manifest]]:
    """Every selected object of ``watched`` in ``namespaces`` (None in it: all), a page at a time.
    Raises ``NotServed`` for a kind the cluster does not serve to the operator."""
    for namespace in namespaces:
        try:
            async for page in kube.list_pages(watched.api_version, watched.kind, namespace, watched.selector):
                yield page
        except ApiError as err:
            if err.status in NOT_SERVED:
                raise NotServed(watched.kind) from err
            raise


async def prime(kube: Kube, cache: ObjectCache, namespaces: Sequence[str | None],
                kinds: Sequence[Watched] = WATCHED) -> dict[str, int]:
    """List ``kinds`` into ``cache`` (what it controls: ``ObjectCache.controlled``; owners first, as
    ``WATCHED`` orders them); the count held of each (a kind not served is left out)."""
    counts: dict[str, int] = {}
    for watched in kinds:
        try:
            async for page in _pages(kube, watched, namespaces):
                held = sum(cache.prime(obj) for obj in page)
                counts[watched.kind] = counts.get(watched.kind, 0) + held
        except NotServed:
            counts.pop(watched.kind, None)
    return counts


async def confirm(kube: Kube, cache: ObjectCache, namespaces: Sequence[str | None],
                  kinds: Sequence[Watched] = WATCHED) -> list[Manifest]:
    """Forget the primed objects that no watch delivered and the API server no longer has; returns them
    (as held). The others are held as listed now (confirmed)."""
    unconfirmed = cache.unconfirmed()
    gone: list[Manifest] = []
    for watched in kinds:
        keys = {key for key in unconfirmed if key[0] == watched.kind}
        if not keys:
            continue
        listed: dict[Key, Manifest] = {}
        with contextlib.suppress(NotServed):  # not any more (the CRD deleted): all of it gone
            async for page in _pages(kube, watched, namespaces):
                listed.update({object_key(obj): obj for obj in page if object_key(obj) in keys})
        for key in sorted(keys, key=str):
            if key in listed:
                cache.observe(listed[key])
            else:
                held = cache.get(*key)
                cache.forget(*key)
                if held is not None:
                    gone.append(held)
    return gone
