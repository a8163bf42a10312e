"""Offline rendering: every object the operator would create for a manifest, like `helm template`."""

from __future__ import annotations

from kuberl.api import InferencePool, RLExperiment, TrainerJob

from .builders import build_experiment_children, build_inference_children, build_trainer_children
from .builders.common import Manifest
from .settings import DEFAULT_BUILD, BuildSettings


def render_resource(obj: RLExperiment | InferencePool | TrainerJob,
                    settings: BuildSettings = DEFAULT_BUILD) -> list[Manifest]:
    """All descendants of ``obj`` in creation order, down to Pods and Services."""
    wire = obj.to_wire()
    if isinstance(obj, InferencePool):
        return build_inference_children(obj, wire, settings=settings)
    if isinstance(obj, TrainerJob):
        return build_trainer_children(obj, wire, settings=settings)
    out: list[Manifest] = []
    for child in build_experiment_children(obj, wire, settings):
        out.append(child)
        if child["kind"] == InferencePool.KIND:
            out += render_resource(InferencePool.model_validate(child), settings)
        elif child["kind"] == TrainerJob.KIND:
            out += render_resource(TrainerJob.model_validate(child), settings)
    return out
