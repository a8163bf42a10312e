"""Gang scheduling: a PodGroup so all pods of a pool start together or not at all."""

from __future__ import annotations

from kuberl.api.spec import GangScheduler, SchedulingSpec

from .common import Manifest, child_metadata

VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


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


def join_gang(pod: Manifest, group: str, scheduling: SchedulingSpec) -> Manifest:
    """Mark ``pod`` as a member of PodGroup ``group`` for the configured gang scheduler."""
    gang = GangScheduler(scheduling.gang)
    if gang == GangScheduler.VOLCANO:
        pod["spec"]["schedulerName"] = "volcano"
        pod["metadata"].setdefault("annotations", {})[VOLCANO_GROUP_ANNOTATION] = group
    elif gang == GangScheduler.COSCHEDULING:
        pod["metadata"]["labels"][COSCHEDULING_GROUP_LABEL] = group
    return pod
