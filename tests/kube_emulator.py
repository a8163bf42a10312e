"""A Kubernetes API server good enough for kopf and kubectl: kmock plus a fidelity layer.

kmock (PyPI, by kopf's author) gives us the HTTP server, API discovery (/api, /apis, resource
lists with kinds, short names, categories, subresources) and Kubernetes-style error bodies. As
shipped it cannot run kopf correctly, so this module supplies the semantics of a real API server
for every registered resource, and nothing else in the tests emulates the API:

* metadata: uid, resourceVersion (one cluster-wide counter), generation (bumped only when
  something outside metadata/status changes), creationTimestamp, generateName; create → 201,
  an existing name → 409 AlreadyExists;
* writes: GET, LIST (with ``kind``/``apiVersion``), POST, PUT (optimistic concurrency on
  resourceVersion), PATCH as JSON merge patch, strategic merge patch (treated as a merge patch)
  or JSON patch, DELETE; a write that changes nothing emits no event and keeps the version;
* the ``status`` subresource: the main endpoint ignores status, ``/status`` changes only status;
* watches resume from ``resourceVersion`` (no replay, so handlers do not re-fire), honour
  ``timeoutSeconds`` and label/field selectors, and stream ``application/json;stream=watch``;
* label selectors (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``) and the
  field selectors ``metadata.name`` / ``metadata.namespace`` (``kube_objects``); lists in pages
  (``limit``/``continue``);
* finalizers (deletionTimestamp until they are gone) and owner-reference garbage collection
  (immediate, cascading; an object created for owners that are already gone is collected at once,
  as the real collector does shortly after);
* ``kubectl get`` tables (``as=Table``) rendered from the CRDs' additionalPrinterColumns, and
  discovery without categories on subresources (or ``kubectl get kuberl`` breaks) and with the
  core group's version named ``v1`` (kmock says ``/v1``; kubectl then finds no ``pods``);
* RBAC for the identities in ``identities`` (bearer token → ``kube_rbac.Grants``; the operator's in
  every operator test is the chart's rendered RBAC): a request they do not grant answers 403 and is
  recorded in ``forbidden``; other tokens (the tests' own kubectl) may do anything;
* bounded request history: kmock keeps every request and re-filters that list on every new one
  (quadratic); here only the last few are kept.

What it does not do (a real cluster's job, see README "What the emulator cannot check"): OpenAPI
schema validation, defaulting, pruning and CEL rules of the CRDs (kubectl needs
``--validate=false``), admission, server-side apply, scheduling and kubelets (tests play the
scheduler and the kubelet by patching pods), and 410 Gone for expired resource versions (a
``Fault("WATCH", plural, 410)`` sends one).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import parsing as kmock_parsing

from .kube_faults import Fault
from .kube_logs import PodLogs
from .kube_objects import (
    age,
    json_copy,
    json_path,
    matches_fields,
    matches_labels,
    merge_patch,
    now_timestamp,
    scale_of,
    with_json_path,
)
from .kube_rbac import Grants

Obj = dict[str, Any]


def _parse_path(path: str, _kmock: Any = kmock_parsing.parse_path) -> Any:
    """kmock's path parser, except for the Namespace kind itself: kmock reads ``/api/v1/namespaces``
    (kopf lists it in namespaced mode) as a namespaced path without a namespace and fails."""
    parts = path.split("?")[0].strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None)
    return _kmock(path)


kmock_parsing.parse_path = _parse_path
Key = tuple[str, str]  # (group, plural)

CORE: dict[str, tuple[str, bool]] = {  # plural -> (kind, namespaced)
    "pods": ("Pod", True),
    "services": ("Service", True),
    "configmaps": ("ConfigMap", True),
    "secrets": ("Secret", True),
    "events": ("Event", True),
    "serviceaccounts": ("ServiceAccount", True),
    "nodes": ("Node", False),
    "namespaces": ("Namespace", False),
}
EXTRA: list[tuple[str, str, str, str, bool]] = [  # group, version, plural, kind, namespaced
    ("events.k8s.io", "v1", "events", "Event", True),
    ("scheduling.volcano.sh", "v1beta1", "podgroups", "PodGroup", True),
    ("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup", True),
    ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", True),
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob", True),
    ("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", "ClusterTrainingRuntime", False),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True),
    ("apps", "v1", "deployments", "Deployment", True),
]
AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}
WITH_STATUS = {"pods", "services", "nodes", "namespaces", "pytorchjobs", "trainjobs", "podgroups"}


def rbac_verb(method: str, name: str | None, watching: bool) -> str:
    """The RBAC verb an HTTP request needs (what the API server's authorizer checks)."""
    if method == "GET":
        return "watch" if watching else "get" if name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]


class ApiError(kmock.KubernetesError):
    """An error rendered by kmock as a metav1.Status body."""


def conflict(message: str) -> ApiError:
    return ApiError(status=409, reason="Conflict", message=message)


@dataclass
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    has_status: bool
    columns: list[Obj] = field(default_factory=list)
    scale: Obj | None = None  # the CRD's scale subresource (specReplicasPath, ...), if it has one

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the fidelity layer described in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._requests: collections.deque[Any] = collections.deque(maxlen=32)
        self.kinds: dict[Key, Kind] = {}
        self.store: dict[Key, dict[tuple[str | None, str], Obj]] = collections.defaultdict(dict)
        self.log: list[tuple[int, Key, str, Obj]] = []
        self.revision = 0
        self._next_change = asyncio.Event()  # set, and replaced by a fresh one, at every change
        self.faults: list[Fault] = []
        self.used: set[tuple[str, str, str]] = set()  # (RBAC verb, API group, resource[/subresource]) asked for
        self.identities: dict[str, Grants] = {}  # bearer token → what it may do (absent: anything)
        self.forbidden: list[str] = []  # requests refused by ``identities``
        self.requests: collections.Counter[str] = collections.Counter()  # RBAC verb → requests served
        self.delivered: collections.Counter[tuple[str, str]] = collections.Counter()  # (plural, name) → times sent
        self._uids: set[str] = set()  # of the objects created here (``_uid_exists``)
        self.pod_logs = PodLogs()  # what GET pods/{name}/log answers (kube_logs)
        for plural, (kind, namespaced) in CORE.items():
            self.register(Kind("", "v1", plural, kind, namespaced, plural in WITH_STATUS))
        for group, version, plural, kind, namespaced in EXTRA:
            self.register(Kind(group, version, plural, kind, namespaced, plural in WITH_STATUS))

    # -- registration -------------------------------------------------------------------------
    def register(self, kind: Kind, short_names: Iterable[str] = (), categories: Iterable[str] = ()) -> None:
        self.kinds[(kind.group, kind.plural)] = kind
        self.resources[f"{kind.api_version}/{kind.plural}"] = kmock.ResourceInfo(
            kind=kind.kind, singular=kind.kind.lower(), namespaced=kind.namespaced, verbs=VERBS,
            shortnames=set(short_names), categories=set(categories),
            subresources=({"status"} if kind.has_status else set()) | ({"scale"} if kind.scale else set()),
        )

    def register_crds(self, directory: Path) -> None:
        for path in sorted(directory.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            spec, version = crd["spec"], crd["spec"]["versions"][0]
            self.register(
                Kind(spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
                     spec["scope"] == "Namespaced", "status" in version.get("subresources", {}),
                     version.get("additionalPrinterColumns", []), version.get("subresources", {}).get("scale")),
                spec["names"].get("shortNames", []), spec["names"].get("categories", []),
            )

    async def _serve_version(self, request: kmock.Request) -> Obj:
        """kmock's resource list, minus the categories/short names it copies onto subresources."""
        listing = await super()._serve_version(request)
        listing["groupVersion"] = listing.get("groupVersion", "").lstrip("/")  # core is "v1", not "/v1"
        for entry in listing.get("resources", []):
            if "/" in entry["name"]:
                entry.update(categories=[], shortNames=[], verbs=["get", "patch", "update"])
            if entry["name"].endswith("/scale"):  # kubectl scale looks for this
                entry.update(kind="Scale", group="autoscaling", version="v1", singularName="")
        return listing

    # -- the object API (also used directly by tests, e.g. to play kubelet) ---------------------
    def kind_of(self, group: str, plural: str) -> Kind:
        try:
            return self.kinds[(group, plural)]
        except KeyError:
            raise ApiError(status=404, reason="NotFound", message=f"the server could not find {plural}") from None

    async def _emit(self, key: Key, kind: str, obj: Obj) -> None:
        self.log.append((int(obj["metadata"]["resourceVersion"]), key, kind, json_copy(obj)))
        # An Event, not a Condition: a watch cancelled at shutdown sat for ever in Condition.wait()
        # re-acquiring its lock (Python 3.11), and the test's event loop never closed.
        change, self._next_change = self._next_change, asyncio.Event()
        change.set()

    def _bump(self, obj: Obj) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def get(self, group: str, plural: str, namespace: str | None, name: str) -> Obj:
        kind = self.kind_of(group, plural)
        obj = self.store[(group, plural)].get((namespace if kind.namespaced else None, name))
        if obj is None:
            raise ApiError(status=404, reason="NotFound", message=f'{plural} "{name}" not found')
        return json_copy(obj)

    def list(self, group: str, plural: str, namespace: str | None = None, labels: str | None = None,
             fields: str | None = None, copy: bool = True) -> list[Obj]:
        """The matching objects (copies; ``copy`` False: the stored ones, for a reply serialized at once —
        a page of a large list then costs its own objects, not every object's copy)."""
        return [
            json_copy(o) if copy else o
            for (ns, _), o in sorted(self.store[(group, plural)].items(), key=lambda kv: str(kv[0]))
            if (namespace is None or ns == namespace)
            and matches_labels(o["metadata"].get("labels") or {}, labels) and matches_fields(o, fields)
        ]

    async def create(self, group: str, plural: str, namespace: str | None, body: Obj) -> Obj:
        kind = self.kind_of(group, plural)
        obj = json_copy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise ApiError(status=422, reason="Invalid", message="metadata.name: Required value")
        ns = (namespace or meta.get("namespace") or "default") if kind.namespaced else None
        store = self.store[(group, plural)]
        if (ns, meta["name"]) in store:
            raise ApiError(status=409, reason="AlreadyExists",
                           message=f'{plural}.{group or "core"} "{meta["name"]}" already exists')
        if ns:
            meta["namespace"] = ns
        if kind.kind == "Secret" and obj.get("stringData"):  # as the API server stores it: data, base64
            encoded = {k: base64.b64encode(str(v).encode()).decode() for k, v in obj.pop("stringData").items()}
            obj["data"] = {**(obj.get("data") or {}), **encoded}
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_timestamp())
        obj.update(apiVersion=kind.api_version, kind=kind.kind)
        if kind.has_status:
            obj["status"] = {"phase": "Pending"} if plural == "pods" else {}
        self._bump(obj)
        store[(ns, meta["name"])] = obj
        self._uids.add(meta["uid"])
        await self._emit((group, plural), "ADDED", obj)
        created = json_copy(obj)
        refs = meta.get("ownerReferences") or []
        if refs and not any(self._uid_exists(ref.get("uid")) for ref in refs):
            await self.delete(group, plural, ns, meta["name"])  # an orphan from birth: the GC takes it
        return created

    def _uid_exists(self, uid: str | None) -> bool:
        """Whether an object with ``uid`` exists (the index of created ones first; a scan for one put in
        ``store`` directly)."""
        return uid in self._uids or any(o["metadata"].get("uid") == uid
                                        for objects in self.store.values() for o in objects.values())

    async def update(self, group: str, plural: str, namespace: str | None, name: str, new: Obj,
                     subresource: str | None = None) -> Obj:
        """Replace an object (PUT semantics); patches are computed by the caller into ``new``."""
        kind = self.kind_of(group, plural)
        key = (namespace if kind.namespaced else None, name)
        old = self.store[(group, plural)].get(key)
        if old is None:
            raise ApiError(status=404, reason="NotFound", message=f'{plural} "{name}" not found')
        expected = (new.get("metadata") or {}).get("resourceVersion")
        if expected and expected != old["metadata"]["resourceVersion"]:
            raise conflict(f'the object "{name}" has been modified; please apply your changes to the latest version')
        obj = json_copy(old)
        if subresource == "status":
            obj["status"] = json_copy(new.get("status"))
        else:
            for k, v in new.items():
                if k not in ("metadata", "status", "apiVersion", "kind"):
                    obj[k] = json_copy(v)
            for k in [k for k in obj if k not in new and k not in ("metadata", "status", "apiVersion", "kind")]:
                del obj[k]
            if not kind.has_status:
                obj["status"] = json_copy(new.get("status"))
            meta = new.get("metadata") or {}
            for k in ("labels", "annotations", "finalizers", "ownerReferences"):
                if meta.get(k) is not None:
                    obj["metadata"][k] = json_copy(meta[k])
                else:
                    obj["metadata"].pop(k, None)
        if obj.get("status") is None:
            obj.pop("status", None)
        if obj == old:
            return json_copy(old)
        if {k: v for k, v in obj.items() if k not in ("metadata", "status")} != \
           {k: v for k, v in old.items() if k not in ("metadata", "status")}:
            obj["metadata"]["generation"] = old["metadata"]["generation"] + 1
        self._bump(obj)
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            return await self._remove(group, plural, key, obj)
        self.store[(group, plural)][key] = obj
        await self._emit((group, plural), "MODIFIED", obj)
        return json_copy(obj)

    async def patch(self, group: str, plural: str, namespace: str | None, name: str, patch: Any,
                    subresource: str | None = None, content_type: str = "application/merge-patch+json") -> Obj:
        current = self.get(group, plural, namespace, name)
        if "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(current, patch)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as err:
                raise ApiError(status=422, reason="Invalid", message=f"the JSON patch did not apply: {err}") from err
        else:
            new = merge_patch(current, patch)
        # A resourceVersion in the patch itself is a precondition (409 if stale), as on a real server.
        precondition = patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
        new["metadata"].pop("resourceVersion", None)
        if precondition:
            new["metadata"]["resourceVersion"] = precondition
        return await self.update(group, plural, namespace, name, new, subresource)

    async def scale(self, group: str, plural: str, namespace: str | None, name: str, method: str,
                    request: kmock.Request) -> Obj:
        """The scale subresource: GET reads the Scale, PUT/PATCH write its spec.replicas into the object's
        specReplicasPath (as the API server does for a CRD with ``subresources.scale``)."""
        kind, obj = self.kind_of(group, plural), self.get(group, plural, namespace, name)
        if not kind.scale:
            raise ApiError(status=404, reason="NotFound", message=f"{plural} has no scale subresource")
        scale = scale_of(obj, kind.scale)
        if scale is None:
            raise ApiError(status=500, reason="InternalError",
                           message=f'the spec replicas field "{kind.scale["specReplicasPath"]}" does not exist')
        if method == "GET":
            return scale
        body = request.data if request.data is not None else json.loads(request.text or "{}")
        new = body if method == "PUT" else merge_patch(scale, body)
        replicas = (new.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(status=422, reason="Invalid", message=f"spec.replicas: Invalid value: {replicas!r}")
        updated = with_json_path(obj, kind.scale["specReplicasPath"], replicas)
        return scale_of(await self.update(group, plural, namespace, name, updated), kind.scale)

    async def delete(self, group: str, plural: str, namespace: str | None, name: str) -> Obj:
        kind = self.kind_of(group, plural)
        key = (namespace if kind.namespaced else None, name)
        obj = self.store[(group, plural)].get(key)
        if obj is None:
            raise ApiError(status=404, reason="NotFound", message=f'{plural} "{name}" not found')
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = now_timestamp()
                self._bump(obj)
                await self._emit((group, plural), "MODIFIED", obj)
            return json_copy(obj)
        return await self._remove(group, plural, key, json_copy(obj))

    async def _remove(self, group: str, plural: str, key: tuple[str | None, str], obj: Obj) -> Obj:
        self.store[(group, plural)].pop(key, None)
        self._uids.discard(obj["metadata"]["uid"])
        self._bump(obj)
        await self._emit((group, plural), "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for (g, p), objects in list(self.store.items()):  # garbage collection of dependents
            for (ns, name), child in list(objects.items()):
                if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or []):
                    await self.delete(g, p, ns, name)
        return obj

    # -- HTTP ---------------------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or (res.group, res.plural) not in self.kinds:
            return await super()._handle(request)  # discovery, version, errors: kmock as is
        g, p, ns, name, sub = res.group, res.plural, request.namespace, request.name, request.subresource
        params, method = request.params, request.method.value.upper()
        watching = method == "GET" and params.get("watch") in ("true", "1")
        resource, rbac = p + (f"/{sub}" if sub else ""), rbac_verb(method, name, watching)
        self.used.add((rbac, g, resource))
        self.requests[rbac] += 1
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        grants = self.identities.get(token)
        if grants is not None and not grants.allows(rbac, g, resource, ns):
            refused = f"{rbac} {g or 'core'}/{resource} in {ns or 'the cluster'}"
            self.forbidden.append(refused)
            raise ApiError(status=403, reason="Forbidden", message=f"{token} cannot {refused}")
        verb = "WATCH" if watching else "LIST" if method == "GET" and name is None else method
        fault = next((f for f in self.faults if f.matches(verb, p, ns, sub)), None)
        if fault is not None and fault.status == 410 and watching:  # as a real server: 200, then an ERROR event
            fault.hits += 1
            return await self._watch_gone(request)
        if fault is not None:
            return await fault.respond()
        if watching:
            return await self._watch(request)
        if (p, sub, method) == ("pods", "log", "GET") and name:
            return self.pod_logs.respond(ns, name, params)
        if sub == "scale" and name:
            return aiohttp.web.json_response(await self.scale(g, p, ns, name, method, request))
        if method == "GET" and name is None:
            return self._list_response(request, self.list(g, p, ns, params.get("labelSelector"),
                                                          params.get("fieldSelector"), copy=False))
        if method == "GET":
            return aiohttp.web.json_response(self.get(g, p, ns, name))
        if method == "POST" and name is None:
            return aiohttp.web.json_response(await self.create(g, p, ns, request.data), status=201)
        if method == "PUT" and name:
            return aiohttp.web.json_response(await self.update(g, p, ns, name, request.data, sub))
        if method == "PATCH" and name:
            content_type = request.headers.get("Content-Type", "application/merge-patch+json")
            data = request.data if request.data is not None else json.loads(request.text or "{}")
            return aiohttp.web.json_response(await self.patch(g, p, ns, name, data, sub, content_type))
        if method == "DELETE" and name:
            return aiohttp.web.json_response(await self.delete(g, p, ns, name))
        raise ApiError(status=405, reason="MethodNotAllowed", message=f"{method} is not supported here")

    def _list_response(self, request: kmock.Request, items: list[Obj]) -> aiohttp.web.Response:
        kind = self.kinds[(request.resource.group, request.resource.plural)]
        meta = {"resourceVersion": str(self.revision)}
        if limit := int(request.params.get("limit") or 0):  # chunks: the continue token is the next offset
            start = int(request.params.get("continue") or 0)
            items, rest = items[start:start + limit], items[start + limit:]
            meta.update({"continue": str(start + limit)} if rest else {})
        self.delivered.update((request.resource.plural, obj["metadata"]["name"]) for obj in items)
        if "as=Table" in request.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(kind, items, meta))
        return aiohttp.web.json_response(
            {"apiVersion": kind.api_version, "kind": f"{kind.kind}List", "metadata": meta, "items": items})

    def _table(self, kind: Kind, items: list[Obj], meta: Obj) -> Obj:
        printer = kind.columns or [AGE_COLUMN]
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        columns += [{"name": c["name"], "type": c["type"], "format": "", "description": "",
                     "priority": c.get("priority", 0)} for c in printer]  # kubectl shows priority > 0 with -o wide
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for c in printer:
                value = json_path(obj, c["jsonPath"])
                cells.append(age(value) if c["type"] == "date" else value)
            partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            rows.append({"cells": cells, "object": partial})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
                "columnDefinitions": columns, "rows": rows}

    async def _watch_gone(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """A watch whose resourceVersion is too old: one ERROR event with a 410 Status, then the end."""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json;stream=watch"})
        await response.prepare(request._raw_request)
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
                  "message": "too old resource version"}
        await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
        await response.write_eof()
        return response

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        g, p, ns = request.resource.group, request.resource.plural, request.namespace
        params = request.params
        labels, fields = params.get("labelSelector"), params.get("fieldSelector")
        if request.name:
            fields = ",".join(filter(None, [fields, f"metadata.name={request.name}"]))
        since = int(params.get("resourceVersion") or 0)
        deadline = asyncio.get_running_loop().time() + float(params.get("timeoutSeconds") or 3600)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json;stream=watch"})
        await response.prepare(request._raw_request)

        def wanted(obj: Obj) -> bool:
            return ((ns is None or obj["metadata"].get("namespace") == ns)
                    and matches_labels(obj["metadata"].get("labels") or {}, labels) and matches_fields(obj, fields))

        async def send(kind: str, obj: Obj) -> None:
            self.delivered[(p, obj["metadata"]["name"])] += 1
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since == 0:  # no version: the current state as ADDED, then changes
            since = self.revision
            for obj in self.list(g, p, ns, labels, fields):
                await send("ADDED", obj)
        cursor = next((i for i, (rv, *_) in enumerate(self.log) if rv > since), len(self.log))
        try:
            while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
                change = self._next_change  # before reading the log: a change while sending sets it
                while cursor < len(self.log):
                    _, key, kind, obj = self.log[cursor]
                    cursor += 1
                    if key == (g, p) and wanted(obj):
                        await send(kind, obj)
                try:
                    async with asyncio.timeout(remaining):
                        await change.wait()
                except TimeoutError:
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response


def kubeconfig(url: str, token: str = "emulator") -> str:
    """A kubeconfig (YAML text) pointing at the emulator, with ``token`` as its user's bearer token."""
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                      "namespace": "default"}}],
    })
