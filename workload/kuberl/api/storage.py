"""Storage rules for an experiment that runs on a cluster (``kuberl validate`` and the operator;
``kuberl run`` skips them: its processes share this machine's disk).

A pod's own filesystem (its image layer, its ``/tmp`` emptyDir) vanishes with the pod, and a gang
restart replaces every trainer pod: a ``file://`` URI on a cluster must therefore lie on a volume
the user names in ``spec.storage.volumes`` (a PersistentVolumeClaim), or be an ``s3://`` URI.
``weightSync.mode: disk`` needs a directory that the trainer and every inference pod share: a
ReadWriteMany claim. One Secret serves every ``s3://`` URI of the experiment.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from .contract import AGENT_TOKEN_SUFFIX, API_TOKEN_SUFFIX, CHECKPOINT_KEY_SUFFIX, api_token_secret_name
from .resolve import FieldIssue
from .resources import InferencePoolSpec, TrainerJobSpec
from .spec import RLExperimentSpec, StorageSpec, VolumeMount, WeightSyncMode
from .tracking import LoggingSpec

RESERVED_MOUNTS = ("/tmp", "/dev", "/etc/kuberl", "/proc", "/sys")


def credentials_secret(spec: RLExperimentSpec) -> str | None:
    """The Secret for every s3:// URI: ``storage.credentialsSecret``, else the older
    ``checkpoint.credentialsSecret``."""
    return spec.storage.credentials_secret or spec.checkpoint.credentials_secret


def _volume_for(path: str, volumes: list[VolumeMount]) -> VolumeMount | None:
    target = PurePosixPath(path)
    for volume in volumes:
        if target == PurePosixPath(volume.mount_path) or PurePosixPath(volume.mount_path) in target.parents:
            return volume
    return None


def _file_uris(spec: RLExperimentSpec) -> list[tuple[str, str, str, bool]]:
    """(field path, the value, its local path, written to?) of every file the pods use: a file:// URI or a
    plain absolute path (the same thing to a pod)."""
    out = []
    for field, uri, written in (("spec.model.path", spec.model.path, False),
                                ("spec.model.initFrom", spec.model.init_from, False),
                                ("spec.model.tokenizer", spec.model.tokenizer, False),
                                ("spec.dataset.path", spec.dataset.path, False),
                                ("spec.evaluation.dataset.path",
                                 spec.evaluation.dataset.path if spec.evaluation and spec.evaluation.dataset else None,
                                 False),
                                ("spec.checkpoint.uri", spec.checkpoint.uri, True)):  # fmt: skip
        if uri and (uri.startswith("file://") or uri.startswith("/")):
            out.append((field, uri, uri.removeprefix("file://"), written))
    return out


MANAGED_SECRET_SUFFIXES = (API_TOKEN_SUFFIX, AGENT_TOKEN_SUFFIX, CHECKPOINT_KEY_SUFFIX)  # the operator's Secrets


def pod_secret_references(storage: StorageSpec, logging: LoggingSpec | None) -> list[tuple[str, str]]:
    """(field, Secret name) of the Secrets ``spec.storage`` and ``spec.logging`` name — the fields an
    RLExperiment, an InferencePool and a TrainerJob share (a pool has no ``logging``)."""
    refs = [("spec.storage.credentialsSecret", storage.credentials_secret),
            ("spec.storage.hubTokenSecret.name", storage.hub_token_secret.name if storage.hub_token_secret else None)]
    if logging is not None:
        refs += [("spec.logging.wandb.apiKeySecret.name",
                  logging.wandb.api_key_secret.name if logging.wandb and logging.wandb.api_key_secret else None),
                 ("spec.logging.mlflow.credentialsSecret",
                  logging.mlflow.credentials_secret if logging.mlflow else None)]
    return [(field, name) for field, name in refs if name]


def secret_references(spec: RLExperimentSpec) -> list[tuple[str, str]]:
    """(field, Secret name) of every Secret the experiment's pods would read (the kubelet resolves
    them, so RBAC never sees who asked)."""
    refs = [(f"spec.agent.env[{i}].valueFrom.secretKeyRef.name", var.value_from.secret_key_ref.name)
            for i, var in enumerate(spec.agent.env if spec.agent else []) if var.value_from is not None]
    if spec.checkpoint.credentials_secret:
        refs.append(("spec.checkpoint.credentialsSecret", spec.checkpoint.credentials_secret))
    return refs + pod_secret_references(spec.storage, spec.logging)


def managed_secret_problem(name: str, own_token: str) -> str | None:
    """Why a manifest may not name Secret ``name``: it is a token KubeRL manages — this experiment's
    API token, or any experiment's API or agent token (``<experiment>-api-token``/``-agent-token``)."""
    if name == own_token:
        return f"{name!r} is the experiment's API token (it steers the trainer and the pool); pods get it themselves"
    if name.endswith(MANAGED_SECRET_SUFFIXES):
        return (f"{name!r} is a token KubeRL manages for an experiment (names ending in "
                f"{' or '.join(MANAGED_SECRET_SUFFIXES)}); name a Secret of your own")
    return None


def credential_endpoints(storage: StorageSpec, logging: LoggingSpec | None,
                         checkpoint_secret: str | None = None) -> list[tuple[str, str | None, bool]]:
    """(endpoint field, its URL, whether a credential is sent there) for every endpoint that may carry one."""
    out = [("spec.storage.endpoint", storage.endpoint, bool(storage.credentials_secret or checkpoint_secret)),
           ("spec.storage.hubEndpoint", storage.hub_endpoint, storage.hub_token_secret is not None)]
    if logging is not None and logging.wandb is not None:
        out.append(("spec.logging.wandb.baseUrl", logging.wandb.base_url, logging.wandb.api_key_secret is not None))
    if logging is not None and logging.mlflow is not None:
        out.append(("spec.logging.mlflow.trackingUri", logging.mlflow.tracking_uri,
                    bool(logging.mlflow.credentials_secret)))
    return out


def insecure_endpoint_issues(storage: StorageSpec, logging: LoggingSpec | None,
                             checkpoint_secret: str | None = None) -> list[FieldIssue]:
    """An ``http://`` endpoint that would receive a credential, unless ``spec.storage.allowInsecureEndpoint``."""
    if storage.allow_insecure_endpoint:
        return []
    return [FieldIssue(field, f"{url!r} is plain http:// and would receive this experiment's credentials; use "
                              "https://, or set spec.storage.allowInsecureEndpoint: true (e.g. an in-cluster MinIO "
                              "without TLS)")
            for field, url, credentialed in credential_endpoints(storage, logging, checkpoint_secret)
            if credentialed and url and url.startswith("http://")]


def borrowed_secret_issues(refs: list[tuple[str, str]], owner: str) -> list[FieldIssue]:
    """One issue per Secret in ``refs`` that KubeRL manages (``owner``'s API token, or any object's
    API/agent token or checkpoint key): a manifest never hands one to its pods."""
    token = api_token_secret_name(owner)
    return [FieldIssue(field, problem) for field, name in refs if (problem := managed_secret_problem(name, token))]


def standalone_issues(spec: InferencePoolSpec | TrainerJobSpec, name: str) -> list[FieldIssue]:
    """Rules for an InferencePool's or TrainerJob's pods on a cluster: it may not borrow another
    object's managed Secrets, whether it stands alone or says it belongs to an experiment, nor send
    credentials to a plain http:// endpoint."""
    logging = getattr(spec, "logging", None)
    return (borrowed_secret_issues(pod_secret_references(spec.storage, logging), name)
            + insecure_endpoint_issues(spec.storage, logging))


def cluster_issues(spec: RLExperimentSpec, experiment: str) -> list[FieldIssue]:
    """Rules for the pods of experiment ``experiment`` on a cluster (Secrets, claims, mounts)."""
    storage = spec.storage
    issues = borrowed_secret_issues(secret_references(spec), experiment)
    issues += insecure_endpoint_issues(storage, spec.logging, spec.checkpoint.credentials_secret)
    if storage.credentials_secret and spec.checkpoint.credentials_secret \
            and storage.credentials_secret != spec.checkpoint.credentials_secret:
        issues.append(FieldIssue("spec.checkpoint.credentialsSecret",
                                 f"is {spec.checkpoint.credentials_secret!r} but spec.storage.credentialsSecret is "
                                 f"{storage.credentials_secret!r}; one Secret serves every s3:// URI: set one"))
    mounts = [PurePosixPath(v.mount_path) for v in storage.volumes]
    for i, mount in enumerate(mounts):
        reserved = [r for r in RESERVED_MOUNTS if mount == PurePosixPath(r) or PurePosixPath(r) in mount.parents
                    or mount in PurePosixPath(r).parents]
        if reserved or str(mount) == "/":
            issues.append(FieldIssue(f"spec.storage.volumes[{i}].mountPath",
                                     f"{str(mount)!r} overlaps a path the pods need ({', '.join(RESERVED_MOUNTS)})"))
        if mount in mounts[:i]:
            issues.append(FieldIssue(f"spec.storage.volumes[{i}].mountPath", f"{str(mount)!r} is mounted twice"))
    for field, uri, path, written in _file_uris(spec):
        volume = _volume_for(path, storage.volumes)
        if volume is None:
            issues.append(FieldIssue(field, f"{uri} on a cluster would be inside a pod's own filesystem, gone when "
                                            "the pod is replaced: mount a PersistentVolumeClaim that holds it "
                                            "(spec.storage.volumes: claimName, mountPath) or use s3:// (kuberl run "
                                            "reads this machine's files as they are)"))
        elif written and volume.read_only:
            issues.append(FieldIssue(field, f"is written by the trainer but volume {volume.claim_name!r} is "
                                            "mounted readOnly"))
    if spec.weight_sync.mode == WeightSyncMode.DISK:
        directory = spec.weight_sync.directory
        volume = _volume_for(directory, storage.volumes) if directory else None
        if volume is None or volume.read_only:
            issues.append(FieldIssue("spec.weightSync.directory",
                                     "mode disk on a cluster needs a directory on a writable ReadWriteMany volume "
                                     "that the trainer and every inference pod mount (spec.storage.volumes); "
                                     "or use mode p2p or broadcast"))
    return issues
