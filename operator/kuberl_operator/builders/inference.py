"""InferencePool → one pod per (replica, host) + a headless Service (+ a PodGroup if gang)."""

from __future__ import annotations

from kuberl.api import InferencePool
from kuberl.api.contract import (
    CONFIG_FILE,
    CONFIG_MOUNT,
    LABEL_ACCELERATOR,
    LABEL_EXPERIMENT,
    LABEL_HOST,
    LABEL_POOL,
    LABEL_REPLICA,
    LABEL_ROLE,
    MASTER_PORT,
    REPLICA_GROUP_PORT,
    ROLE_INFERENCE,
    inference_pod_name,
    inference_replica_host,
)
from kuberl.api.roles import inference_env

from ..accelerators import profile
from ..settings import DEFAULT_BUILD, BuildSettings
from .access import metadata_egress, network_policy
from .common import (
    Manifest,
    container_resources,
    env_list,
    headless_service,
    pod_manifest,
    with_template_hash,
)
from .gang import join_gang, pod_group


def pool_selector(pool: InferencePool) -> dict[str, str]:
    return {LABEL_POOL: pool.metadata.name, LABEL_ROLE: ROLE_INFERENCE}


def build_inference_pod(pool: InferencePool, parent: Manifest, replica: int, host: int,
                        token_version: str = "", settings: BuildSettings = DEFAULT_BUILD) -> Manifest:
    spec, name = pool.spec, pool.metadata.name
    accel = profile(spec.accelerator, str(spec.engine), settings)
    pod_name = inference_pod_name(name, replica, host)
    # Engine, parallel degrees and the rest come from the run config (the ConfigMap); the env only
    # says who this pod is (docs/architecture.md, "The contract").
    exchange = (spec.trainer_address, MASTER_PORT + 1) if spec.trainer_address else None  # the p2p store
    hosts = None  # a replica over several hosts: which one this pod is, and where they meet (host 0)
    if spec.hosts_per_replica > 1:
        hosts = (host, spec.hosts_per_replica, f"{inference_replica_host(name, replica)}:{REPLICA_GROUP_PORT}")
    env = {**accel.env, **inference_env(replica, spec.port, exchange, hosts)}
    container: Manifest = {
        "name": "inference",
        "command": ["python", "-m", "kuberl.inference"],
        "args": ["--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}", "--port", str(spec.port)],
        "env": env_list(env),
        "ports": [{"name": "http", "containerPort": spec.port}],
        "resources": container_resources(spec, accel, spec.accelerators_per_host),
    }
    if host == 0:
        probe = {"httpGet": {"path": "/health", "port": spec.port}, "periodSeconds": 10}
        container["readinessProbe"] = {**probe, "failureThreshold": 3}
        container["startupProbe"] = {**probe, "failureThreshold": 180}
        # /health is 503 once the engine is gone (loop crashed, a weight load failed part-way) or hangs
        # (work waiting, no engine step for 60 s):
        # the kubelet replaces the replica, and the pool goes on with the others meanwhile.
        container["livenessProbe"] = {**probe, "failureThreshold": 6}
    labels = {
        LABEL_EXPERIMENT: spec.experiment or name,
        LABEL_ROLE: ROLE_INFERENCE,
        LABEL_POOL: name,
        LABEL_REPLICA: str(replica),
        LABEL_HOST: str(host),
        LABEL_ACCELERATOR: str(spec.accelerator),
    }
    pod = pod_manifest(
        parent, name=pod_name, subdomain=name, labels=labels, placement=spec,
        scheduling=spec.scheduling, accel=accel, container=container,
        config_map=spec.config_map, restart_policy="Always", storage=spec.storage,
        config_revision=spec.config_revision, token_version=token_version,
    )
    own = (name, spec.replicas * spec.hosts_per_replica)  # a standalone pool is its own gang
    group, members = (spec.gang.group, spec.gang.members) if spec.gang else own
    return with_template_hash(join_gang(pod, group, members, spec.scheduling))


def build_inference_pods(pool: InferencePool, parent: Manifest, token_version: str = "",
                         settings: BuildSettings = DEFAULT_BUILD) -> list[Manifest]:
    return [
        build_inference_pod(pool, parent, r, h, token_version, settings)
        for r in range(pool.spec.replicas)
        for h in range(pool.spec.hosts_per_replica)
    ]


def build_inference_children(pool: InferencePool, parent: Manifest, token_version: str = "",
                             settings: BuildSettings = DEFAULT_BUILD) -> list[Manifest]:
    """Service, the NetworkPolicy and PodGroup of a standalone pool (an experiment's pods are under the
    experiment's and join its gang), then the pods; ``parent`` is the pool as stored (with uid);
    ``token_version``: a standalone pool's own token (``common.pod_manifest``)."""
    out = [headless_service(parent, pool.metadata.name, pool_selector(pool), {"http": pool.spec.port})]
    spec = pool.spec
    if not spec.experiment:
        out.append(network_policy(parent, pool.metadata.name, settings.peers, [spec.port],
                                  metadata=metadata_egress(spec.storage, settings), standalone=True))
    labels = profile(spec.accelerator, str(spec.engine), settings).labels
    group = None if spec.gang else pod_group(parent, pool.metadata.name, spec.replicas * spec.hosts_per_replica,
                                             spec.scheduling, labels)
    if group:
        out.append(group)
    return out + ([] if pool.spec.suspend else build_inference_pods(pool, parent, token_version, settings))
