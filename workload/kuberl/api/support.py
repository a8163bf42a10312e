"""What this build can run, as opposed to what the spec can express: rules about the
implementation, applied by ``kuberl validate``, ``kuberl run`` and the operator, so that a manifest
they accept does not fail at start-up instead. ``resolve`` still plans such a spec (the weight
planner and ``--simulate`` use it); these rules refuse to run it. Lift a rule here when the feature
lands.
"""

from __future__ import annotations

from .resolve import FieldIssue, TrainerPlan, resolve
from .rewards import reward_issue
from .spec import (
    Backend,
    Engine,
    RLExperimentSpec,
    TrainerRuntime,
    trainjob_problems,
)

MEGATRON_SCOPE = ("backend megatron trains with tensor, pipeline, expert and data parallelism in this build "
                  "(kuberl.megatron), each expert whole on a rank")


def unsupported_issues(spec: RLExperimentSpec, trainer: TrainerPlan | None) -> list[FieldIssue]:
    """``trainer``: the trainer plan ``resolve`` settled on (None when it found other issues). Every
    ``spec.model.dtype`` trains on Megatron as on FSDP2 (float32 parameters, forward and backward in
    the compute dtype)."""
    issues = _reward_issues(spec) + _runtime_issues(spec) + _routing_issues(spec) + _lora_issues(spec)
    if trainer is None or trainer.backend != Backend.MEGATRON:
        if spec.trainer.distributed_optimizer:
            issues.append(FieldIssue("spec.trainer.distributedOptimizer", "is true: backend fsdp already shards the "
                                                                          "optimizer's state with the weights (FSDP2); "
                                                                          "set it false"))
        return issues
    if spec.trainer.lora is not None:
        issues.append(FieldIssue("spec.trainer.lora", "is set: backend megatron trains the whole model in this "
                                                      "build; remove it or use backend fsdp"))
    if spec.trainer.activation_checkpointing:
        issues.append(FieldIssue("spec.trainer.activationCheckpointing",
                                 "is true: backend megatron does not recompute activations in this build; set it "
                                 "false or use backend fsdp"))
    return issues + [FieldIssue(f"spec.trainer.parallelism.{field}", f"is {value}: {MEGATRON_SCOPE}; {field} must be 1")
                     for field, value in (("expertTensor", trainer.expert_tensor),) if value != 1]


def _routing_issues(spec: RLExperimentSpec) -> list[FieldIssue]:
    """Routes come from the torch engine only (whether the model has experts is known where it loads:
    the trainer refuses a dense one at start-up)."""
    if not spec.algorithm.routing_replay:
        return []
    inference, _, _ = resolve(spec)
    if inference is None or inference.engine == Engine.TORCH:
        return []
    return [FieldIssue("spec.algorithm.routingReplay", f"is true: engine {inference.engine} does not return the "
                                                       "experts it chose in this build; use engine torch")]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


def _lora_issues(spec: RLExperimentSpec) -> list[FieldIssue]:
    """vLLM serves adapters up to its largest LoRA rank (whether the target modules exist is known
    where the model loads: trainer and engines refuse a spec whose targets match no layer at start-up)."""
    if spec.trainer.lora is None or spec.trainer.lora.rank <= VLLM_MAX_LORA_RANK:
        return []
    inference, _, _ = resolve(spec)
    if inference is None or inference.engine != Engine.VLLM:
        return []
    return [FieldIssue("spec.trainer.lora.rank", f"is {spec.trainer.lora.rank}: engine vllm serves adapters of "
                                                 f"rank ≤ {VLLM_MAX_LORA_RANK}")]


def _runtime_issues(spec: RLExperimentSpec) -> list[FieldIssue]:
    if TrainerRuntime(spec.trainer.runtime) != TrainerRuntime.TRAINJOB:
        return []
    problems = trainjob_problems(spec.scheduling, spec.trainer.backoff_limit, whole_experiment=True)
    return [FieldIssue(f"spec.{'trainer.' if field == 'backoffLimit' else ''}{field}", why) for field, why in problems]


def _reward_issues(spec: RLExperimentSpec) -> list[FieldIssue]:
    """A ``kuberl.rewards:NAME`` that KubeRL does not ship (a user's own module is checked where it
    can be imported: ``kuberl validate``'s environment checks, and the trainer at start-up)."""
    named = [("spec.reward.function", spec.reward.function)]
    if spec.evaluation is not None and spec.evaluation.reward is not None:
        named.append(("spec.evaluation.reward.function", spec.evaluation.reward.function))
    return [FieldIssue(field, message) for field, function in named if (message := reward_issue(function))]
