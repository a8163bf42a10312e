"""Pieces every child manifest shares: metadata, owner references, secure pod scaffolding."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kuberl.api.contract import (
    ANNOTATION_CONFIG_REVISION,
    ANNOTATION_TEMPLATE_HASH,
    ANNOTATION_TOKEN_VERSION,
    API_TOKEN_KEY,
    CONFIG_MOUNT,
    ENV_API_TOKEN,
    ENV_HUB_ENDPOINT,
    ENV_HUB_TOKEN,
    ENV_S3_ENDPOINT,
    ENV_WANDB_API_KEY,
    ENV_WANDB_BASE_URL,
    LABEL_EXPERIMENT,
    MANAGED_BY,
    MLFLOW_SECRET_KEYS,
    PODINFO_MOUNT,
    api_token_secret_name,
)
from kuberl.api.pods import ResourceRequirements
from kuberl.api.spec import PodPlacement, SchedulingSpec, StorageSpec
from kuberl.api.tracking import LoggingSpec

from ..accelerators import AcceleratorProfile

Manifest = dict[str, Any]

RUN_AS_USER = 1000


def template_hash(obj: Manifest) -> str:
    """16 hex digits of SHA-256 over what a pod runs: its labels, annotations (but this hash) and spec."""
    meta = obj["metadata"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != ANNOTATION_TEMPLATE_HASH}
    text = json.dumps([meta.get("labels") or {}, annotations, obj.get("spec")], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_template_hash(obj: Manifest) -> Manifest:
    """``obj`` annotated with its ``template_hash``: ``reconcile`` replaces objects whose hash differs."""
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_TEMPLATE_HASH] = template_hash(obj)
    return obj


def owner_reference(parent: Manifest) -> Manifest:
    """A controller owner reference to ``parent`` (needs its uid), for garbage collection."""
    meta = parent["metadata"]
    return {
        "apiVersion": parent["apiVersion"],
        "kind": parent["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(parent: Manifest, name: str, labels: dict[str, str]) -> Manifest:
    """Metadata of a child: same namespace, owner reference, our labels (not the parent's)."""
    meta: Manifest = {"name": name, "labels": {**MANAGED_BY, **labels}}
    if parent["metadata"].get("uid"):  # absent only in an offline render
        meta["ownerReferences"] = [owner_reference(parent)]
    if parent["metadata"].get("namespace"):
        meta["namespace"] = parent["metadata"]["namespace"]
    return meta


def headless_service(parent: Manifest, name: str, selector: dict[str, str], ports: dict[str, int]) -> Manifest:
    """Headless Service giving each pod a stable DNS name ``<hostname>.<name>``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(parent, name, selector),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": k, "port": v, "targetPort": v} for k, v in ports.items()],
        },
    }


DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}  # a floor: never BestEffort, the first pods evicted
_QUANTITY_SUFFIXES = {"": 1, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity as a number ("16Gi" → 17179869184, "500m" → 0.5, "1e3" → 1000)."""
    number = quantity.rstrip("KMGTPEimk")
    return float(number) * _QUANTITY_SUFFIXES[quantity[len(number):]]


def with_defaults(res: ResourceRequirements | None, floors: dict[str, str],
                  memory_limit: str) -> tuple[dict[str, str], dict[str, str]]:
    """(requests, limits): the user's, with cpu and memory requests defaulting to ``floors`` (or to
    the limit, when only a limit is given) and the memory limit to ``memory_limit`` (or to the
    request, when that is larger: a limit is never below its request)."""
    requests = dict(res.requests or {}) if res else {}
    limits = dict(res.limits or {}) if res else {}
    for name, floor in floors.items():
        requests.setdefault(name, limits.get(name, floor))
    if "memory" not in limits:
        limits["memory"] = max(memory_limit, requests["memory"], key=quantity_value)
    return requests, limits


def scaled(quantity: str, factor: int) -> str:
    """``quantity`` × ``factor`` in the same unit ("96Gi" × 8 → "768Gi")."""
    number = quantity.rstrip("KMGTPEimk")
    value = float(number) * factor
    return f"{int(value) if value.is_integer() else value}{quantity[len(number):]}"


def default_requests(accel: AcceleratorProfile, devices: int) -> dict[str, str]:
    """What a pod of ``devices`` accelerators requests when its manifest does not say: the profile's
    share of a node per device (never below ``DEFAULT_REQUESTS``), and its scratch volume's size as
    ephemeral storage (the model cache and checkpoint staging live there)."""
    if accel.resource is None:
        return dict(DEFAULT_REQUESTS)
    share = {"cpu": scaled(accel.cpu_per_device, devices), "memory": scaled(accel.memory_per_device, devices)}
    return {name: max(share[name], floor, key=quantity_value) for name, floor in DEFAULT_REQUESTS.items()} | {
        "ephemeral-storage": accel.scratch_size}


def container_resources(placement: PodPlacement, accel: AcceleratorProfile, devices: int) -> Manifest:
    """User requests/limits (``with_defaults``: :func:`default_requests`, the accelerator's memory
    limit, at least the memory request) plus the accelerator's extended resource (requests = limits).
    Requests the manifest gives win, per role (``inference.resources``, ``trainer.resources``)."""
    requests, limits = with_defaults(placement.resources, default_requests(accel, devices), accel.memory_limit)
    if accel.resource:
        requests[accel.resource] = limits[accel.resource] = str(devices)
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def scratch_size(placement: PodPlacement, accel: AcceleratorProfile) -> str:
    """The /tmp volume's size limit: ``resources.limits.ephemeral-storage`` or the accelerator's default."""
    limits = (placement.resources.limits or {}) if placement.resources else {}
    return limits.get("ephemeral-storage", accel.scratch_size)


def env_list(env: dict[str, str]) -> list[Manifest]:
    fields = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP",
              "NODE_NAME": "spec.nodeName"}
    out = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in fields.items()]
    return out + [{"name": k, "value": v} for k, v in env.items()]


def secret_env(env: str, secret: str, key: str, optional: bool = False) -> Manifest:
    """Env var ``env`` from key ``key`` of Secret ``secret``: a ``secretKeyRef``, never a value in the pod
    spec (``optional``: the pod starts without it when the Secret lacks the key)."""
    ref = {"name": secret, "key": key, **({"optional": True} if optional else {})}
    return {"name": env, "valueFrom": {"secretKeyRef": ref}}


def api_token_env(experiment: str) -> Manifest:
    """The token as a pod sees it: ``KUBERL_API_TOKEN`` from the Secret, never a literal value."""
    return secret_env(ENV_API_TOKEN, api_token_secret_name(experiment), API_TOKEN_KEY)


S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": False, "AWS_SECRET_ACCESS_KEY": False, "AWS_SESSION_TOKEN": True}


def storage_env(storage: StorageSpec) -> list[Manifest]:
    """S3 and hub access for the workload: credentials and the hub token only as ``secretKeyRef`` (never
    values in the pod spec), endpoints and region as plain values (``KUBERL_S3_ENDPOINT``:
    kuberl.checkpoint.store; ``HF_ENDPOINT``: kuberl.models.hub, kuberl.data.tables)."""
    out: list[Manifest] = []
    if storage.credentials_secret:
        out += [secret_env(key, storage.credentials_secret, key, optional) for key, optional in S3_SECRET_KEYS.items()]
    if storage.endpoint:
        out.append({"name": ENV_S3_ENDPOINT, "value": storage.endpoint})
    if storage.region:
        out += [{"name": name, "value": storage.region} for name in ("AWS_REGION", "AWS_DEFAULT_REGION")]
    if storage.hub_token_secret:
        out.append(secret_env(ENV_HUB_TOKEN, storage.hub_token_secret.name, storage.hub_token_secret.key))
    if storage.hub_endpoint:
        out.append({"name": ENV_HUB_ENDPOINT, "value": storage.hub_endpoint})
    return out


def tracking_env(logging: LoggingSpec) -> list[Manifest]:
    """W&B and MLflow access for trainer rank 0's trackers (``spec.logging``): the API key and MLflow's
    credentials only as ``secretKeyRef`` (each MLflow key optional: a Secret holds a token, or a user
    and password), a self-hosted W&B server's URL as a value; the libraries read these themselves."""
    out: list[Manifest] = []
    if logging.wandb is not None and logging.wandb.api_key_secret is not None:
        ref = logging.wandb.api_key_secret
        out.append(secret_env(ENV_WANDB_API_KEY, ref.name, ref.key))
    if logging.wandb is not None and logging.wandb.base_url:
        out.append({"name": ENV_WANDB_BASE_URL, "value": logging.wandb.base_url})
    if logging.mlflow is not None and logging.mlflow.credentials_secret:
        out += [secret_env(key, logging.mlflow.credentials_secret, key, optional=True) for key in MLFLOW_SECRET_KEYS]
    return out


def storage_volumes(storage: StorageSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts) for ``spec.storage.volumes``: PersistentVolumeClaims."""
    volumes = [{"name": f"storage-{i}", "persistentVolumeClaim": {"claimName": v.claim_name,
                                                                  **({"readOnly": True} if v.read_only else {})}}
               for i, v in enumerate(storage.volumes)]  # fmt: skip
    mounts = [{"name": f"storage-{i}", "mountPath": v.mount_path, **({"readOnly": True} if v.read_only else {})}
              for i, v in enumerate(storage.volumes)]
    return volumes, mounts


def pod_volumes(placement: PodPlacement, accel: AcceleratorProfile, config_map: str | None,
                storage: StorageSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts): pod info (downward API), shm, the size-limited /tmp scratch, the run
    config, and the experiment's PersistentVolumeClaims."""
    mounts = [{"name": "podinfo", "mountPath": PODINFO_MOUNT, "readOnly": True},
              {"name": "shm", "mountPath": "/dev/shm"},
              {"name": "scratch", "mountPath": "/tmp"}]
    volumes: list[Manifest] = [
        {"name": "podinfo", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
        ]}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": accel.shm_size}},
        {"name": "scratch", "emptyDir": {"sizeLimit": scratch_size(placement, accel)}},
    ]
    if config_map:
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config_map}})
    claim_volumes, claim_mounts = storage_volumes(storage)
    return volumes + claim_volumes, mounts + claim_mounts


def pod_manifest(
    parent: Manifest,
    *,
    name: str,
    subdomain: str,
    labels: dict[str, str],
    placement: PodPlacement,
    scheduling: SchedulingSpec,
    accel: AcceleratorProfile,
    container: Manifest,
    config_map: str | None,
    restart_policy: str,
    storage: StorageSpec,
    config_revision: str | None = None,
    token_version: str = "",
) -> Manifest:
    """A non-root, no-privilege pod with config, pod-info (downward API), shm and scratch volumes,
    the experiment's API token (env from its Secret; ``labels`` name the experiment) and its storage
    (S3 env from a Secret, PersistentVolumeClaims). ``token_version`` (``access.token_version``) is
    a standalone pool's or job's own token: a new one replaces the pod (an experiment's children carry
    theirs in ``config_revision``)."""
    volumes, mounts = pod_volumes(placement, accel, config_map, storage)
    accel_env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in accel.field_env.items()]
    full_container = {
        **container,
        "env": [*(container.get("env") or []), *accel_env, api_token_env(labels[LABEL_EXPERIMENT]),
                *storage_env(storage)],
        "image": placement.image or accel.image,
        "imagePullPolicy": "IfNotPresent",
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,  # writes go to /tmp, /dev/shm and the named volumes
        },
    }
    spec: Manifest = {
        "hostname": name,
        "subdomain": subdomain,
        "restartPolicy": restart_policy,
        "automountServiceAccountToken": False,  # workload pods never talk to the API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [full_container],
        "volumes": volumes,
    }
    if accel.supplemental_groups:
        spec["securityContext"]["supplementalGroups"] = list(accel.supplemental_groups)
    if storage.service_account_name:  # workload identity: the pod's credentials come with its account
        spec["serviceAccountName"] = storage.service_account_name
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = [t.to_wire() for t in placement.tolerations]
    if scheduling.priority_class_name:
        spec["priorityClassName"] = scheduling.priority_class_name
    meta = child_metadata(parent, name, {**accel.labels, **labels})
    annotations = {ANNOTATION_CONFIG_REVISION: config_revision, ANNOTATION_TOKEN_VERSION: token_version}
    if any(annotations.values()):  # part of what the pod runs (template_hash): a new one replaces the pod
        meta["annotations"] = {k: v for k, v in annotations.items() if v}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
