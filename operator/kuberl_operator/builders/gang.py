"""Gang scheduling and queue admission: all pods of an experiment — its pool's and its trainer's —
start together or not at all. One PodGroup per experiment (Volcano, coscheduling; a standalone pool or
job has its own), or with Kueue one pod group (``kueue.x-k8s.io/pod-group-name`` and the total count
on every pod: Kueue's plain-pod group integration admits them as one Workload, gating every pod until
then). ``scheduling.queue`` is the Volcano Queue with ``gang: volcano`` and the Kueue LocalQueue
otherwise: one value is never written as both."""

from __future__ import annotations

from kuberl.api.spec import GangScheduler, SchedulingSpec

from .common import Manifest, child_metadata

VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"


def pod_group(parent: Manifest, name: str, min_member: int, scheduling: SchedulingSpec,
              labels: dict[str, str] | None = None) -> Manifest | None:
    """The PodGroup for ``scheduling.gang`` (None when gang scheduling is off); ``labels``: the
    accelerator's (Volcano's Ascend plugin reads ``ring-controller.atlas`` on the PodGroup too)."""
    gang = GangScheduler(scheduling.gang)
    if gang == GangScheduler.NONE:
        return None
    api = "scheduling.volcano.sh/v1beta1" if gang == GangScheduler.VOLCANO else "scheduling.x-k8s.io/v1alpha1"
    spec: Manifest = {"minMember": min_member}
    if gang == GangScheduler.VOLCANO and scheduling.queue:
        spec["queue"] = scheduling.queue
    if scheduling.priority_class_name:
        spec["priorityClassName"] = scheduling.priority_class_name
    return {"apiVersion": api, "kind": "PodGroup", "metadata": child_metadata(parent, name, dict(labels or {})),
            "spec": spec}


def join_gang(pod: Manifest, group: str, members: int, scheduling: SchedulingSpec) -> Manifest:
    """Mark ``pod`` as one of the ``members`` pods of gang ``group`` for the configured gang scheduler
    and, with a Kueue queue, of Kueue pod group ``group``."""
    gang = GangScheduler(scheduling.gang)
    if gang == GangScheduler.VOLCANO:
        pod["spec"]["schedulerName"] = "volcano"
        pod["metadata"].setdefault("annotations", {})[VOLCANO_GROUP_ANNOTATION] = group
    elif gang == GangScheduler.COSCHEDULING:
        pod["metadata"]["labels"][COSCHEDULING_GROUP_LABEL] = group
    if queue := scheduling.kueue_queue:
        pod["metadata"]["labels"] |= {KUEUE_QUEUE_LABEL: queue, KUEUE_GROUP_LABEL: group}
        pod["metadata"].setdefault("annotations", {})[KUEUE_TOTAL_ANNOTATION] = str(members)
    return pod
