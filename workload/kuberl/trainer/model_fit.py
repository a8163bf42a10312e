"""What the policy's own architecture refuses of a spec: routing replay on a model without experts,
a Megatron layout its layers or experts do not split over, a LoRA adapter whose target modules match
none of its modules. Known once the model's config is: the trainer checks at start-up
(:func:`kuberl.trainer.loop.make_actor`), ``kuberl validate`` before any pod starts wherever it can
read the config (:func:`kuberl.models.loading.model_shape`: builtin, ``file://``, ``hf://``)."""

from __future__ import annotations

import torch

from ..api import FieldIssue
from ..api.resolve import resolve
from ..api.spec import Backend, RLExperimentSpec
from ..megatron.model import layout_issues
from ..models import moe_routing
from ..models.loading import on_meta
from ..models.lora import AdapterError, add_adapter

TARGETS_FIELD = "spec.trainer.lora.targetModules"


def model_issues(spec: RLExperimentSpec, model: torch.nn.Module) -> list[FieldIssue]:
    """Each field of ``spec`` that ``model`` (an HF causal LM, on ``meta`` or not) cannot train with."""
    _, plan, _ = resolve(spec)
    issues = []
    if spec.algorithm.routing_replay and not moe_routing.routers(model):
        issues.append(FieldIssue("spec.algorithm.routingReplay", f"is true but {spec.model.path} has no "
                                                                 "mixture-of-experts router to replay"))
    if plan is not None and plan.backend == Backend.MEGATRON:
        issues += [FieldIssue(f, m) for f, m in layout_issues(model.config, plan.expert, plan.pipeline)]
    if spec.trainer.lora is not None:
        try:  # on a copy without storage: the adapter only has to find its modules
            add_adapter(on_meta(model.config), spec.trainer.lora)
        except AdapterError as err:
            issues.append(FieldIssue(TARGETS_FIELD, str(err).removeprefix(f"{TARGETS_FIELD} ")))
    return issues
