"""Pure builders: custom resources in, Kubernetes manifests (plain dicts) out. No API calls."""

from .experiment import build_experiment_children
from .inference import build_inference_children
from .trainer import build_trainer_children

__all__ = ["build_experiment_children", "build_inference_children", "build_trainer_children"]
