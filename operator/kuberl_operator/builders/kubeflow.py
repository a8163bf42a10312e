"""The trainer's pod template handed to Kubeflow: a PyTorchJob (``trainer.runtime: kubeflow``, the
training operator's kubeflow.org/v1) or a TrainJob (``trainjob``, Kubeflow Trainer v2), each built from
the Kubeflow SDK's own models — ``kubeflow-training`` and ``kubeflow-trainer-api``, which check every
field's type as the object is made — from the same native rank-0 pod ``trainer.build_trainer_pod``
makes, so the three runtimes run the same container.

Both SDKs are imported when a job of their runtime is built (≈ 1 s each), not when the operator starts.
"""

from __future__ import annotations

from typing import Any

from kuberl.api import TrainerJob
from kuberl.api.contract import (
    CONFIG_FILE,
    CONFIG_MOUNT,
    LABEL_RANK,
    TRAINJOB_NODE,
    TRAINJOB_RUNTIME,
)
from kuberl.api.spec import restart_limit

from .common import Manifest, child_metadata, with_template_hash
from .gang import KUEUE_GROUP_LABEL, KUEUE_QUEUE_LABEL, KUEUE_TOTAL_ANNOTATION

TRAINER_COMMAND = f"exec torchrun -m kuberl.trainer --config {CONFIG_MOUNT}/{CONFIG_FILE}"
# What Kubeflow injects into the trainer container (torchrun reads PET_* as defaults for its flags): the
# native pod's own values would contradict it, so the templates leave them out.
KUBEFLOW_INJECTED = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NNODES", "NODE_RANK", "NPROC_PER_NODE"}
KUBEFLOW_CONTAINER, KUBEFLOW_PORT_NAME = "pytorch", "pytorchjob-port"
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION = "kubeflow.org", "v1"
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
PYTORCHJOB_API_VERSION = f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}"
TRAINER_API_VERSION = f"{TRAINER_GROUP}/{TRAINER_VERSION}"
TRAINJOB_MANAGER = "kuberl.io/operator"


def _container(pod: Manifest) -> Manifest:
    """The native pod's trainer container, with torchrun taking its rendezvous from Kubeflow."""
    container = dict(pod["spec"]["containers"][0])
    container["env"] = [e for e in container["env"] if e["name"] not in KUBEFLOW_INJECTED]
    container["args"] = [TRAINER_COMMAND]
    return container


def _pod_metadata(pod: Manifest) -> Manifest:
    """Labels and annotations every replica shares: no per-rank label."""
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k != LABEL_RANK}
    annotations = pod["metadata"].get("annotations")
    return {"labels": labels, **({"annotations": dict(annotations)} if annotations else {})}


def kubeflow_template(pod: Manifest) -> Manifest:
    """A native trainer pod → the template every PyTorchJob replica shares: container "pytorch"
    (the one Kubeflow injects into), its dist port named "pytorchjob-port" (Kubeflow's master port),
    torchrun without rendezvous flags (PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
    PET_MASTER_ADDR, PET_MASTER_PORT come from Kubeflow), no per-rank name, hostname or label."""
    spec = {k: v for k, v in pod["spec"].items() if k not in ("hostname", "subdomain")}
    container = _container(pod) | {"name": KUBEFLOW_CONTAINER}
    container["ports"] = [{**p, "name": KUBEFLOW_PORT_NAME} if p["name"] == "dist" else p for p in container["ports"]]
    return {"metadata": _pod_metadata(pod), "spec": {**spec, "containers": [container]}}


def build_pytorchjob(job: TrainerJob, parent: Manifest, pod: Manifest, labels: dict[str, str]) -> Manifest:
    """Kubeflow runtime: the trainer pod template as a kubeflow.org/v1 PyTorchJob labelled ``labels``,
    Master (node 0) plus nodes − 1 Workers; Kubeflow names the pods ``<job>-master-0`` / ``<job>-worker-N``."""
    from kubeflow.training import models

    template = kubeflow_template(pod)

    def replicas(count: int) -> Any:
        return models.KubeflowOrgV1ReplicaSpec(replicas=count, restart_policy="Never", template=template)

    specs = {"Master": replicas(1), **({"Worker": replicas(job.spec.nodes - 1)} if job.spec.nodes > 1 else {})}
    pytorchjob = models.KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB_API_VERSION,
        kind="PyTorchJob",
        metadata=child_metadata(parent, job.metadata.name, labels),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            run_policy=models.KubeflowOrgV1RunPolicy(
                backoff_limit=restart_limit(job.spec.backoff_limit), suspend=job.spec.suspend,
                clean_pod_policy="None"),  # rank 0's termination message outlives the job
            nproc_per_node=str(job.spec.procs_per_node),
            pytorch_replica_specs=specs,
        ),
    )
    return with_template_hash(openapi_wire(pytorchjob))


def openapi_wire(value: Any) -> Any:
    """An OpenAPI-generated model (kubeflow-training's) as its JSON form: each set attribute under its
    wire name (``attribute_map``), recursively; dicts and lists element by element. (The SDK's own
    ``ApiClient.sanitize_for_serialization`` does the same but needs an HTTP client object.)"""
    if isinstance(value, dict):
        return {k: openapi_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [openapi_wire(v) for v in value]
    if hasattr(value, "attribute_map"):
        return {wire: openapi_wire(getattr(value, attr)) for attr, wire in value.attribute_map.items()
                if getattr(value, attr) is not None}
    return value


def trainjob_patch(pod: Manifest) -> Manifest:
    """What the TrainJob sets on the runtime's "node" pods beyond ``spec.trainer``: our labels and
    annotations (without Kueue's plain-pod group: Kueue admits the TrainJob itself), volumes, placement,
    security contexts, service account — the fields Kubeflow Trainer lets a runtime patch set. The rest
    (no service-account token, no service links, the ports, the termination message) the chart's
    ClusterTrainingRuntime sets."""
    spec = pod["spec"]
    container = spec["containers"][0]
    shared = _pod_metadata(pod)
    labels = {k: v for k, v in shared["labels"].items() if k not in (KUEUE_QUEUE_LABEL, KUEUE_GROUP_LABEL)}
    annotations = {k: v for k, v in shared.get("annotations", {}).items() if k != KUEUE_TOTAL_ANNOTATION}
    metadata = {"labels": labels, **({"annotations": annotations} if annotations else {})}
    pod_spec = {key: spec[key] for key in ("volumes", "securityContext", "nodeSelector", "tolerations",
                                           "affinity", "serviceAccountName") if spec.get(key)}
    pod_spec["containers"] = [{"name": TRAINJOB_NODE, "volumeMounts": container["volumeMounts"],
                               "securityContext": container["securityContext"]}]
    job_template = {"metadata": metadata, "spec": {"template": {"metadata": metadata, "spec": pod_spec}}}
    return {"manager": TRAINJOB_MANAGER, "trainingRuntimeSpec": {"template": {
        "metadata": {"labels": labels},
        "spec": {"replicatedJobs": [{"name": TRAINJOB_NODE, "template": job_template}]}}}}


def build_trainjob(job: TrainerJob, parent: Manifest, pod: Manifest, labels: dict[str, str]) -> Manifest:
    """Kubeflow Trainer v2: a ``TrainJob`` labelled ``labels`` on the ClusterTrainingRuntime
    ``kuberl-torch`` (the chart's): ``spec.trainer`` carries the image, command, env, node count,
    processes per node and resources of the native rank-0 pod; ``runtimePatches`` the rest
    (``trainjob_patch``). JobSet makes the pods (``<job>-node-0-<rank>-<random>``, rank 0 at
    ``<job>-node-0-0.<job>``) and restarts them by the runtime's failure policy. A standalone job's
    Kueue queue goes on the TrainJob (Kueue's TrainJob integration admits it whole)."""
    from kubeflow_trainer_api import models

    container = _container(pod)
    metadata = child_metadata(parent, job.metadata.name, labels)
    if queue := job.spec.scheduling.kueue_queue:
        metadata["labels"][KUEUE_QUEUE_LABEL] = queue
    trainjob = models.TrainerV1alpha1TrainJob.from_dict({
        "apiVersion": TRAINER_API_VERSION,
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": TRAINJOB_RUNTIME, "kind": "ClusterTrainingRuntime",
                           "apiGroup": TRAINER_GROUP},
            "suspend": job.spec.suspend,
            "trainer": {
                "image": container["image"],
                "command": container["command"],
                "args": container["args"],
                "env": container["env"],
                "numNodes": job.spec.nodes,
                "numProcPerNode": job.spec.procs_per_node,
                "resourcesPerNode": container["resources"],
            },
            "runtimePatches": [trainjob_patch(pod)],
        },
    })
    return with_template_hash(trainjob.to_dict())
