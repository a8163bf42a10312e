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

import logging
from collections.abc import Sequence

from .cache import ObjectCache
from .kube import ApiError, Kube, Manifest
from .watches import WATCHED, Watched

log = logging.getLogger("kuberl.operator")

NOT_SERVED = (403, 404)  # a kind the cluster does not have (no CRD) or the operator may not list: kopf warns


async def _list(kube: Kube, watched: Watched, namespaces: Sequence[str | None]) -> list[Manifest] | None:
    """Every selected object of ``watched`` in ``namespaces`` (None in it: all); None if not served."""
    items: list[Manifest] = []
    for namespace in namespaces:
        try:
            items += await kube.list_all(watched.api_version, watched.kind, namespace, watched.selector)
        except ApiError as err:
            if err.status not in NOT_SERVED:
                raise
            return None
    return items


async def prime(kube: Kube, cache: ObjectCache, namespaces: Sequence[str | None],
                kinds: Sequence[Watched] = WATCHED) -> dict[str, int]:
    """List ``kinds`` into ``cache``; the count held of each (a kind not served is left out)."""
    counts: dict[str, int] = {}
    for watched in kinds:
        items = await _list(kube, watched, namespaces)
        if items is None:
            continue
        for obj in items:
            cache.prime(obj)
        counts[watched.kind] = len(items)
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
        items = await _list(kube, watched, namespaces) or []
        listed = {(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]): obj for obj in items}
        for key in sorted(keys, key=str):
            if key in listed:
                cache.observe(listed[key])
            else:
                held = cache.get(*key)
                cache.forget(*key)
                if held is not None:
                    gone.append(held)
    return gone
