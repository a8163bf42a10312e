"""What this build can run, as opposed to what the spec can express: rules about the
implementation, applied by ``kuberl validate``, ``kuberl run`` and the operator, so that a manifest
they accept does not fail at start-up instead. ``resolve`` still plans such a spec (the weight
planner and ``--simulate`` use it); these rules refuse to run it. Lift a rule here when the feature
lands.
"""

from __future__ import annotations

from .resolve import FieldIssue, TrainerPlan
from .spec import Accelerator, Backend, ModelDtype, RLExperimentSpec

MEGATRON_SCOPE = ("backend megatron trains with tensor, expert and data parallelism only in this build "
                  "(kuberl.megatron)")


def unsupported_issues(spec: RLExperimentSpec, trainer: TrainerPlan | None) -> list[FieldIssue]:
    """``trainer``: the trainer plan ``resolve`` settled on (None when it found other issues)."""
    if trainer is None or trainer.backend != Backend.MEGATRON:
        return []
    issues = [FieldIssue(f"spec.trainer.parallelism.{field}", f"is {value}: {MEGATRON_SCOPE}; {field} must be 1")
              for field, value in (("pipeline", trainer.pipeline),
                                   ("expertTensor", trainer.expert_tensor))
              if value != 1]  # fmt: skip
    on_cpu = spec.trainer.accelerator == Accelerator.CPU
    if not (spec.model.dtype == ModelDtype.FLOAT32 or (spec.model.dtype == ModelDtype.AUTO and on_cpu)):
        issues.append(FieldIssue("spec.model.dtype", "backend megatron computes in float32 in this build; "
                                 "set float32 (auto is bfloat16 on accelerators)"))
    return issues
