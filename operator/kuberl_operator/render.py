"""Offline rendering: every object the operator would create for a manifest, like `helm template`."""

from __future__ import annotations

from kuberl.api import InferencePool, RLExperiment, TrainerJob

from .builders import build_experiment_children, build_inference_children, build_trainer_children
from .builders.common import Manifest


def render_resource(obj: RLExperiment | InferencePool | TrainerJob) -> list[Manifest]:
    """All descendants of ``obj`` in creation order, down to Pods and Services."""
    wire = obj.to_wire()
    if isinstance(obj, InferencePool):
        return build_inference_children(obj, wire)
    if isinstance(obj, TrainerJob):
        return build_trainer_children(obj, wire)
    out: list[Manifest] = []
    for child in build_experiment_children(obj, wire):
        out.append(child)
        if child["kind"] == InferencePool.KIND:
            out += render_resource(InferencePool.model_validate(child))
        elif child["kind"] == TrainerJob.KIND:
            out += render_resource(TrainerJob.model_validate(child))
    return out
