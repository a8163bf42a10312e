"""The Megatron-core backend's builder (registered in :mod:`kuberl.trainer.backends`)."""

from __future__ import annotations

from ..policy.backend import BackendInputs
from .actor import MegatronActor


def build(inputs: BackendInputs) -> MegatronActor:
    """Megatron's parallel groups from the plan (data: world ÷ (tensor · pipeline · context)), then the
    GPTModel actor; ``ppo``'s critic is the FSDP2 HF value model (``inputs.hf_critic``)."""
    from megatron.core import parallel_state

    spec, plan = inputs.spec, inputs.plan
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=plan.tensor,
                                             pipeline_model_parallel_size=plan.pipeline,
                                             context_parallel_size=plan.context,
                                             expert_model_parallel_size=plan.expert,
                                             expert_tensor_parallel_size=plan.expert_tensor)
    return MegatronActor.from_hf(inputs.model, inputs.config, spec.algorithm.learning_rate,
                                 spec.rollout.temperature, spec.algorithm.mini_batches, inputs.device, spec.seed,
                                 inputs.dtype, critic=inputs.hf_critic() if inputs.critic else None,
                                 distributed_optimizer=spec.trainer.distributed_optimizer,
                                 packing=spec.trainer.packing, weights=inputs.weights)
