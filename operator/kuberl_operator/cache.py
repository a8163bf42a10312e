"""What the watches delivered, kept in memory: the operator reconciles from it instead of reading
the API server again for every event (docs/architecture.md, "Reading from the watches").

``ObjectCache`` holds the latest version of every object of the watched kinds (fed by the informers,
``informer``: ``observe`` / ``forget``) and of what the operator itself just wrote (``Kube`` results),
so a sync right after a create sees its child without waiting for the watch. A version older than
the one held never replaces it (resource versions compared as numbers when they are numbers). A
label index answers ``list(selector)`` without a scan. The informers re-list every watched kind each
resync, deliver each object again and report what the list no longer has; as a last resort, an
entry not delivered again within ``max_age`` seconds (two resyncs) counts as gone.

Only what the operator controls is held (``roots``; controller-runtime's cache transforms are the
model): an object of a root kind (the custom resources), one the operator wrote, and one whose
controller owner reference names an object held (by uid: an experiment's pool, a pool's pods, a
PyTorchJob's pods). The watches select children by labels anyone can put on their own objects; a
look-alike is dropped as it arrives, copying nothing, so another tenant's ConfigMaps and pods cost
the operator no memory. Owners are listed before their children at start-up (``watches.WATCHED``).

``CachedKube`` is a ``Kube`` whose reads of those kinds come from the cache; every other kind, and
every write, goes to the API server (writes then update the cache). Secrets are not watched (that
would need list on every Secret of the namespace): a Secret read is remembered for
``secret_seconds`` (the API token is checked for rotation that often).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .kube import Credentials, Kube, Manifest
from .ratelimit import RateLimit
from .settings import DEFAULT_MAX_IN_FLIGHT

Key = tuple[str, str | None, str]  # kind, namespace, name


def object_key(obj: Manifest) -> Key:
    """(kind, namespace, name) of an object: how the cache, the work queue and routing name it."""
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace"), meta["name"]


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def json_copy(value: Any) -> Any:
    """A copy of a JSON-shaped value (dicts, lists, scalars): what ``copy.deepcopy`` returns for one,
    about three times faster (no memo, no dispatch on type) — the cache copies every object it hands out."""
    if type(value) is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if type(value) is list:
        return [json_copy(v) for v in value]
    return value


SHARED_TEXT = 64  # characters: keys and values up to this long are held once however many objects repeat them


def _held(value: Any) -> Any:
    """``json_copy`` for what the cache holds: keys and short strings interned (``sys.intern``), so
    the field names and label values thousands of objects repeat are held once, not once each."""
    if type(value) is dict:
        return {sys.intern(k): _held(v) for k, v in value.items()}
    if type(value) is list:
        return [_held(v) for v in value]
    if type(value) is str and len(value) <= SHARED_TEXT:
        return sys.intern(value)
    return value


def slim(obj: Manifest) -> Manifest:
    """What the operator reads of ``obj`` (a copy): no managedFields or kubectl's last-applied copy
    of the spec, and of a pod only its node (reconcile reads a pod's metadata and status; it never
    patches a pod's spec) — pods are most of what is held and most of their bytes are spec."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    if LAST_APPLIED in (meta.get("annotations") or {}):
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k != LAST_APPLIED}
    out = {**obj, "metadata": meta}
    if obj.get("kind") == "Pod":
        out["spec"] = {k: v for k, v in (obj.get("spec") or {}).items() if k == "nodeName"}
    return _held(out)


def _newer_or_same(held: Manifest, incoming: Manifest) -> bool:
    """Whether ``incoming`` is not older than ``held`` (numeric resource versions; else: yes)."""
    a, b = held["metadata"].get("resourceVersion"), incoming["metadata"].get("resourceVersion")
    if isinstance(a, str) and isinstance(b, str) and a.isdigit() and b.isdigit():
        return int(b) >= int(a)
    return True


OWN_VERSIONS = 8  # of one object, remembered to tell their watch echoes from someone else's change
ON_WRITE: contextvars.ContextVar[Callable[[Key], None] | None] = contextvars.ContextVar("kuberl_on_write",
                                                                                      default=None)
"""What the running sync does with each object it writes (created or patched), as the write answers:
ask for the syncs the write calls for (``handlers``). None outside a sync."""


class ObjectCache:
    """Objects by (kind, namespace, name), with an index of (kind, namespace, label, value) → names.
    Used from the operator's event loop only: no method awaits, so none needs a lock."""

    def __init__(self, max_age: float = float("inf"), clock: Callable[[], float] = time.monotonic,
                 refresh: float = float("inf"), roots: Iterable[str] | None = None,
                 groups: Mapping[str, str] | None = None) -> None:
        """``roots``: the kinds held whoever owns them; any other object only if the operator wrote it
        or its controller is held (None: every object delivered, for a cache of one kind's tests).
        ``groups``: the API group each kind is held from (``watches.WATCHED``'s): the key names a kind,
        and a kind of the same name from another group (Gateway API's InferencePool beside ours) is
        never held, nor does its deletion evict ours (``of_our_group``)."""
        self._objects: dict[Key, Manifest] = {}
        self._groups = dict(groups or {})
        self._roots = frozenset(roots) if roots is not None else None
        self._uids: dict[str, Key] = {}  # of the objects held
        self._written: set[str] = set()  # uids of the objects the operator wrote (held whatever their owner)
        self.refused = 0  # objects delivered and not held: not the operator's
        self._seen: dict[Key, float] = {}
        self._ours: dict[Key, deque[str | None]] = defaultdict(lambda: deque(maxlen=OWN_VERSIONS))
        self._creating: set[Key] = set()  # the operator's creates in flight (``creating``)
        self._by_label: dict[tuple[str, str | None, str, str], set[str]] = defaultdict(set)
        self._max_age, self._clock, self._refresh = max_age, clock, refresh

    def _unindex(self, key: Key) -> None:
        self._seen.pop(key, None)
        old = self._objects.pop(key, None)
        uid = (old or {}).get("metadata", {}).get("uid")
        if uid is not None and self._uids.get(uid) == key:
            del self._uids[uid]
        for label, value in ((old or {}).get("metadata", {}).get("labels") or {}).items():
            names = self._by_label.get((key[0], key[1], label, value))
            if names is not None:
                names.discard(key[2])
                if not names:
                    del self._by_label[(key[0], key[1], label, value)]

    def _drop(self, key: Key) -> None:
        self._written.discard((self._objects.get(key) or {}).get("metadata", {}).get("uid", ""))
        self._unindex(key)
        self._ours.pop(key, None)

    def controlled(self, obj: Manifest) -> bool:
        """Whether ``obj`` is the operator's to hold: a root kind, written by the operator, or controlled
        (owner reference with ``controller: true``) by an object held."""
        meta = obj["metadata"]
        if self._roots is None or obj.get("kind") in self._roots or meta.get("uid") in self._written:
            return True
        return any(ref.get("controller") and ref.get("uid") in self._uids for ref in meta.get("ownerReferences") or [])

    def of_our_group(self, obj: Manifest) -> bool:
        """Whether ``obj``'s API group is the one its kind is held from (any, for a kind not in ``groups``)."""
        group = (obj.get("apiVersion") or "").rpartition("/")[0]
        return self._groups.get(obj.get("kind", ""), group) == group

    def observe(self, obj: Manifest, quiet: bool = False) -> bool:
        """An object as a watch or a write delivered it; ``quiet``: the operator's own write (a create,
        a spec, a status, a pod's labels: whatever it calls for, its sync asked for itself). Returns
        whether it is news — anything but the watch's echo of one of the last ``OWN_VERSIONS`` own
        writes of the object (and that too when it was not delivered for ``refresh`` seconds: a
        resync's re-list re-syncs everything). A version older than the one held does not replace
        it; it is news unless it is an own write's late echo: someone changed the object before the
        operator's write that the cache already holds (a kubelet's status under a label patch)."""
        if not self.of_our_group(obj):  # another API's kind of the same name: not ours, ours stays
            self.refused += 1
            return False
        key = object_key(obj)
        version = obj["metadata"].get("resourceVersion")
        held = self._objects.get(key)
        if held is None and key in self._creating:  # the watch was quicker than the create's answer
            quiet = True
        if quiet:
            self._ours[key].append(version)
            if obj["metadata"].get("uid"):
                self._written.add(obj["metadata"]["uid"])
        elif not self.controlled(obj):  # a look-alike (or one whose controller went): not held, not news
            self.refused += 1
            if held is not None:
                self._drop(key)
            return False
        news = version not in self._ours.get(key, ()) or self._clock() - self._seen.get(key, 0.0) > self._refresh
        if held is not None and version is not None and held["metadata"].get("resourceVersion") == version:
            self._seen[key] = self._clock()  # the version held (a write's echo, a re-list): nothing to copy
            return news
        obj = slim(obj)
        if held is not None and not _newer_or_same(held, obj):
            return news
        self._unindex(key)
        self._objects[key] = obj
        self._seen[key] = self._clock()
        if obj["metadata"].get("uid"):
            self._uids[obj["metadata"]["uid"]] = key
        for label, value in (obj["metadata"].get("labels") or {}).items():
            self._by_label[(key[0], key[1], label, value)].add(key[2])
        return news

    @contextlib.contextmanager
    def creating(self, obj: Manifest) -> Iterator[None]:
        """While the operator's create of ``obj`` is in flight, its watch event (which may come before
        the answer) is the echo of the operator's own write, not news (an "expectation")."""
        key = object_key(obj)
        self._creating.add(key)
        try:
            yield
        finally:
            self._creating.discard(key)

    def mark_terminating(self, kind: str, namespace: str | None, name: str) -> None:
        """The operator deleted the object: held as terminating until its watch says it is gone."""
        key = (kind, namespace, name)
        held = self._current(key)
        if held is not None and not held["metadata"].get("deletionTimestamp"):
            self._objects[key] = {**held, "metadata": {**held["metadata"], "deletionTimestamp": "deleting"}}

    def forget(self, kind: str, namespace: str | None, name: str) -> None:
        self._drop((kind, namespace, name))

    def _current(self, key: Key) -> Manifest | None:
        """The held object, unless it has not been delivered for ``max_age`` (then it is dropped)."""
        if key in self._seen and self._clock() - self._seen[key] > self._max_age:
            self._drop(key)
        return self._objects.get(key)

    def get(self, kind: str, namespace: str | None, name: str) -> Manifest | None:
        obj = self._current((kind, namespace, name))
        return json_copy(obj) if obj is not None else None  # a held object is replaced, never changed

    def list(self, kind: str, namespace: str | None, selector: dict[str, str]) -> list[Manifest]:
        """Objects of ``kind`` in ``namespace`` whose labels include every pair of ``selector``."""
        sets = [self._by_label.get((kind, namespace, k, v), set()) for k, v in selector.items()]
        names = set.intersection(*sets) if sets else {n for (k, ns, n) in self._objects
                                                       if k == kind and ns == namespace}
        found = [self._current((kind, namespace, n)) for n in sorted(names)]
        return [json_copy(obj) for obj in found if obj is not None]

    def held(self, kind: str) -> list[Manifest]:
        """Every current object of ``kind``, as held (not copies: read them, never change them). Linear
        in all that is held: for a scan every few seconds (the progress poller), not per event."""
        keys = [key for key in self._objects if key[0] == kind]
        return [obj for key in keys if (obj := self._current(key)) is not None]

    def __len__(self) -> int:
        return len(self._objects)


class CachedKube(Kube):
    """``Kube`` reading the ``cached`` kinds from an ``ObjectCache`` (see the module doc)."""

    def __init__(self, credentials: Credentials, cache: ObjectCache, cached: Iterable[str], timeout: float = 30.0,
                 limit: RateLimit | None = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 secret_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(credentials, timeout, limit, max_in_flight)
        self.cache, self.cached = cache, frozenset(cached)
        self._secrets: dict[Key, tuple[float, Manifest | None]] = {}
        self._secret_seconds, self._clock = secret_seconds, clock

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        if kind in self.cached:
            return self.cache.get(kind, namespace, name)
        if kind == "Secret":
            held = self._secrets.get((kind, namespace, name))
            if held is not None and self._clock() - held[0] < self._secret_seconds:
                return json_copy(held[1])
            secret = await super().get(api_version, kind, namespace, name)
            self._remember_secret((kind, namespace, name), secret)
            return secret
        return await super().get(api_version, kind, namespace, name)

    def _remember_secret(self, key: Key, secret: Manifest | None) -> None:
        """Hold ``secret`` for ``secret_seconds``; those older are dropped now (a deleted experiment's
        token is not kept in memory for the operator's lifetime)."""
        now = self._clock()
        self._secrets = {k: v for k, v in self._secrets.items() if now - v[0] < self._secret_seconds}
        self._secrets[key] = (now, json_copy(secret))

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: dict[str, str]) -> list[Manifest]:
        if kind in self.cached:
            return self.cache.list(kind, namespace, selector)
        return await super().list(api_version, kind, namespace, selector)

    def _remember(self, obj: Manifest) -> None:
        """A write's result: held as news nobody needs to hear again (its watch echo triggers nothing)
        and handed to the running sync's ``ON_WRITE`` (the syncs it calls for: ``handlers``)."""
        if obj.get("kind") in self.cached:
            self.cache.observe(obj, quiet=True)
        elif obj.get("kind") == "Secret":
            self._remember_secret(object_key(obj), obj)
        on_write = ON_WRITE.get()
        if on_write is not None:
            on_write(object_key(obj))

    async def create(self, obj: Manifest) -> Manifest:
        if obj.get("kind") not in self.cached:
            created = await super().create(obj)
        else:
            with self.cache.creating(obj):
                created = await super().create(obj)
        self._remember(created)
        return created

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: Manifest,
                    subresource: str | None = None) -> Manifest:
        patched = await super().patch(api_version, kind, namespace, name, patch, subresource)
        self._remember(patched)
        return patched

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     foreground: bool = False) -> bool:
        """Delete; the cached object is marked terminating until its watch says it is gone."""
        deleted = await super().delete(api_version, kind, namespace, name, foreground)
        if kind == "Secret":
            self._secrets.pop((kind, namespace, name), None)
        if kind in self.cached:
            self.cache.mark_terminating(kind, namespace, name)
        return deleted
