"""What this build can run, as opposed to what the spec can express: rules about the
implementation, applied by ``kuberl validate``, ``kuberl run`` and the operator, so that a manifest
they accept does not fail at start-up instead. ``resolve`` still plans such a spec (the weight
planner and ``--simulate`` use it); these rules refuse to run it. Lift a rule here when the feature
lands.
"""

from __future__ import annotations

from .resolve import FieldIssue, TrainerPlan
from .spec import Backend, RLExperimentSpec

MEGATRON_SCOPE = ("backend megatron trains with tensor, pipeline, expert and data parallelism in this build "
                  "(kuberl.megatron), each expert whole on a rank")


def unsupported_issues(spec: RLExperimentSpec, trainer: TrainerPlan | None) -> list[FieldIssue]:
    """``trainer``: the trainer plan ``resolve`` settled on (None when it found other issues). Every
    ``spec.model.dtype`` trains on Megatron as on FSDP2 (float32 parameters, forward and backward in
    the compute dtype)."""
    if trainer is None or trainer.backend != Backend.MEGATRON:
        return []
    return [FieldIssue(f"spec.trainer.parallelism.{field}", f"is {value}: {MEGATRON_SCOPE}; {field} must be 1")
            for field, value in (("expertTensor", trainer.expert_tensor),) if value != 1]
