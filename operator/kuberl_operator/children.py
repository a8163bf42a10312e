"""Converging one object's children — the steps every sync is made of: create what is missing
(``ensure``; never adopting or rewriting someone else's object), bring a child's spec or data in line,
prune and replace pods (``converge_pods``), delete what a removed field made (``delete_owned``), the
API token Secrets (``ensure_api_token``), write a status only when it changed (``write_status``), and
say what went wrong in an Event (``post_event``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets

from kuberl.api import API_GROUP, InferencePool, TrainerJob
from kuberl.api.contract import ANNOTATION_TEMPLATE_HASH

from .builders.access import api_token_secret
from .builders.events import object_event
from .kube import ApiError, Kube, Manifest
from .patch import merge_patch_to, overlay_patch_to
from .replacement import pods_to_replace
from .status import merge_conditions, without_times

log = logging.getLogger("kuberl.operator")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NotOurs(RuntimeError):
    """A child's name is taken by an object its parent does not control."""


def controller_uid(meta: Manifest) -> str | None:
    return next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


async def ensure(kube: Kube, obj: Manifest, new_owner: bool = False) -> Manifest:
    """Create ``obj`` if absent; bring an existing object's spec or data in line (``updated_field``;
    a merge patch that also removes the fields the desired object no longer has).
    Raises NotOurs (and touches nothing) when the existing object is controlled by another owner
    or by none: a user's ConfigMap that happens to carry the name is never adopted or rewritten.
    ``new_owner``: the owner was never synced (it has no status), so ``obj`` is almost surely absent:
    create it without reading first (a read the cache cannot answer costs a round trip); a 409 reads."""
    meta = obj["metadata"]
    key = (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    existing = None if new_owner else await kube.get(*key)
    if existing is None:
        try:
            created = await kube.create(obj)
            log.debug("created %s/%s", obj["kind"], meta["name"])  # routine: ~10 per experiment
            return created
        except ApiError as err:
            if err.status != 409:
                raise
            existing = await kube.read(*key)  # it exists, whatever a cache says
            if existing is None:
                raise
    owner = controller_uid(meta)
    if owner is not None and controller_uid(existing["metadata"]) != owner:
        raise NotOurs(f"{obj['kind']} {meta['name']!r} already exists and is not controlled by "
                      f"{meta['ownerReferences'][0]['kind']} {meta['ownerReferences'][0]['name']!r}; rename or "
                      "remove it")
    field = updated_field(obj)
    if field is not None and existing.get(field) != obj.get(field):
        compute = overlay_patch_to if obj["kind"] in SERVER_DEFAULTED else merge_patch_to
        patch = compute(existing.get(field) or {}, obj.get(field) or {})
        if patch != {}:
            existing = await kube.patch(*key, {field: patch})
            log.debug("updated %s/%s %s", obj["kind"], meta["name"], field)
    return existing


SERVER_DEFAULTED = ("Deployment", "PodGroup")  # kept in line only in the fields we set (a scheduler's webhook
# defaults the rest); a PodGroup's minMember follows the experiment's size (a scale changes it)


def updated_field(obj: Manifest) -> str | None:
    """What ``ensure`` keeps in line with the desired object: a custom resource's, NetworkPolicy's,
    Deployment's or PodGroup's spec (the last two only in the fields we set: the API server or the
    scheduler defaults the rest), a ConfigMap's data. Secrets (the API token) and Services are only
    ever created; pods are replaced, never patched (``prune_pods``)."""
    if obj["apiVersion"].startswith(f"{API_GROUP}/") or obj["kind"] in ("NetworkPolicy", *SERVER_DEFAULTED):
        return "spec"
    return "data" if obj["kind"] == "ConfigMap" else None


async def ensure_api_token(kube: Kube, owner: Manifest, experiment: str, name: str | None = None) -> Manifest:
    """The experiment's API token Secret (docs/architecture.md, "Who may call what"), or its Secret
    ``name`` of the same shape (the agent's token, the checkpoint key): created once with 32 fresh
    random bytes, owned by ``owner``, never rewritten while it exists; returned as stored (a token's
    version: ``access.token_version``)."""
    secret = api_token_secret(owner, experiment, secrets.token_urlsafe(32), name)
    return await ensure(kube, secret, new_owner=not owner.get("status"))


async def delete_owned(kube: Kube, parent: Manifest, api_version: str, kind: str, name: str,
                       foreground: bool = False) -> bool:
    """Delete ``parent``'s child ``kind``/``name`` if it exists and ``parent`` controls it (what a
    removed spec field created); returns whether it was there (``foreground``: ``Kube.delete``'s).
    Another owner's object is left alone."""
    namespace = parent["metadata"].get("namespace")
    child = await kube.get(api_version, kind, namespace, name)
    if child is None or controller_uid(child["metadata"]) != parent["metadata"].get("uid"):
        return False
    if not child["metadata"].get("deletionTimestamp"):
        await kube.delete(api_version, kind, namespace, name, foreground)
        log.info("deleted %s/%s: its spec field is gone", kind, name)
    return True


def template_changed(stored: Manifest, desired: Manifest) -> bool:
    old, new = ((o["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH) for o in (stored, desired))
    return old is not None and new is not None and old != new


async def prune_pods(kube: Kube, parent: Manifest, selector: dict[str, str], keep: set[str]) -> None:
    """Delete ``parent``'s pods matching ``selector`` whose names are not in ``keep`` (suspend,
    scale-down); pods someone else controls are left alone, whatever their labels say."""
    namespace = parent["metadata"].get("namespace")
    for pod in await kube.list("v1", "Pod", namespace, selector):
        name = pod["metadata"]["name"]
        if controller_uid(pod["metadata"]) != parent["metadata"].get("uid"):
            continue
        if name not in keep and not pod["metadata"].get("deletionTimestamp"):
            await kube.delete("v1", "Pod", namespace, name)
            log.info("deleted Pod/%s", name)


async def write_status(kube: Kube, obj: Manifest, status: Manifest) -> bool:
    """Patch ``status`` only when it changed (a no-op write would wake every watcher; returns
    whether it wrote), and only if ``obj`` is still current: two syncs of one object can race (its
    own event and a child's), and the one that read an older version must not overwrite the newer
    one's status. The loser gets 409 Conflict, which it raises: its sync is retried on fresh state
    (``handlers.sync_object``) and nothing after the write happens in the lost one."""
    old = obj.get("status") or {}
    status = {**status, "conditions": merge_conditions(old.get("conditions") or [], status["conditions"], now())}
    if without_times({**old, **status}) == without_times(old):
        return False
    meta = obj["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
    await kube.patch(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], patch, "status")
    return True


async def owned_pods(kube: Kube, parent: Manifest, selector: dict[str, str]) -> list[Manifest]:
    pods = await kube.list("v1", "Pod", parent["metadata"].get("namespace"), selector)
    return [p for p in pods if controller_uid(p["metadata"]) == parent["metadata"].get("uid")]


POD_BATCH = 64


async def converge_pods(kube: Kube, parent: Manifest, children: list[Manifest], selector: dict[str, str],
                    gang: bool) -> list[Manifest]:
    """Create what is missing, prune pods no longer wanted, replace pods whose template changed
    (``replacement``: the whole gang, or one replica at a time); returns ``parent``'s pods. The
    pods are created ``POD_BATCH`` at a time, concurrently (independent of each other; the client
    bounds what is in flight), after the other children, in order."""
    pods_wanted = [c for c in children if c["kind"] == "Pod"]
    for child in children:
        if child["kind"] != "Pod":
            await ensure(kube, child)
    for start in range(0, len(pods_wanted), POD_BATCH):
        await asyncio.gather(*(ensure(kube, pod) for pod in pods_wanted[start:start + POD_BATCH]))
    desired = {c["metadata"]["name"]: (c["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH, "")
               for c in pods_wanted}
    await prune_pods(kube, parent, selector, set(desired))
    pods = await owned_pods(kube, parent, selector)
    doomed = pods_to_replace(desired, pods, gang)
    for name in doomed:  # the next sync (on their deletion) recreates them from the new template
        await kube.delete("v1", "Pod", parent["metadata"].get("namespace"), name)
        log.info("replacing Pod/%s: its template changed", name)
    return await owned_pods(kube, parent, selector) if doomed else pods


STARTS_PODS = (InferencePool.KIND, TrainerJob.KIND, "Deployment")


async def ensure_in_stages(kube: Kube, children: list[Manifest]) -> dict[str, Manifest]:
    """``ensure`` an experiment's children in two stages, each stage's at once: first what its pods
    use or are fenced by (ConfigMap, NetworkPolicy, Service), then what starts pods (pool, job, the
    agent's Deployment). A child whose name is taken (``NotOurs``) stops the second stage: no pod
    starts beside a ConfigMap or a policy that is not ours. Returns the stored children by kind."""
    first = [c for c in children if c["kind"] not in STARTS_PODS]
    second = [c for c in children if c["kind"] in STARTS_PODS]
    stored: dict[str, Manifest] = {}
    for stage in (first, second):
        results = await asyncio.gather(*(ensure(kube, c) for c in stage), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raised = next((f for f in failed if isinstance(f, NotOurs)), failed[0])
            for other in failed:
                if other is not raised:  # the sync's retry ensures it again
                    log.info("%s: also failed in the same stage (%s)", type(other).__name__, other)
            raise raised
        stored.update({c["kind"]: r for c, r in zip(stage, results, strict=True)})
    return stored


async def post_event(kube: Kube, involved: Manifest, reason: str, message: str, event_type: str = "Warning") -> None:
    """An Event about ``involved`` (``builders.events``; ``event_type`` Warning or Normal). An Event is a
    report, not state: one that cannot be written is logged, never raised."""
    try:
        await kube.create(object_event(involved, reason, message, now(), event_type))
    except Exception as err:
        log.warning("%s %s: Event %s not written (%s)", involved.get("kind"), involved["metadata"]["name"], reason, err)
