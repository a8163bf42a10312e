"""The FSDP2 backend's builder (registered in :mod:`kuberl.trainer.backends`)."""

from __future__ import annotations

from ..policy.backend import BackendInputs
from .actor import FSDPActor


def build(inputs: BackendInputs) -> FSDPActor:
    """Every rank a data-parallel rank (no groups to form beyond the default); the critic from the
    unsharded policy, before any LoRA adapter (:meth:`FSDPActor.create`)."""
    spec = inputs.spec
    return FSDPActor.create(inputs.model, inputs.config, spec.algorithm.learning_rate, spec.rollout.temperature,
                            spec.algorithm.mini_batches, inputs.device, inputs.dtype, weights=inputs.weights,
                            activation_checkpointing=spec.trainer.activation_checkpointing,
                            packing=spec.trainer.packing, critic=inputs.critic, adapter=spec.trainer.lora,
                            seed=spec.seed)  # LoRA targets the model lacks: refused before (model_issues)
