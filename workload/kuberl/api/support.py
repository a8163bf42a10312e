"""What this build can run, as opposed to what the spec can express: rules about the
implementation, applied by ``kuberl validate``, ``kuberl run`` and the operator, so that a manifest
they accept does not fail at start-up instead. ``resolve`` still plans such a spec (the weight
planner and ``--simulate`` use it); these rules refuse to run it. Lift a rule here when the feature
lands.
"""

from __future__ import annotations

from .resolve import FieldIssue
from .spec import Backend, RLExperimentSpec


def unsupported_issues(spec: RLExperimentSpec, backend: Backend | None) -> list[FieldIssue]:
    """``backend``: the trainer backend ``resolve`` settled on (None when it found other issues)."""
    if backend == Backend.MEGATRON:
        return [FieldIssue("spec.trainer.backend",
                           "megatron cannot train in this build yet: its Megatron-core training loop needs CUDA or "
                           "NPU devices to verify (the weight conversion and model building exist, "
                           "kuberl.megatron); use backend fsdp (e.g. allocation 'vllm:d4t4+fsdp:d32')")]
    return []
