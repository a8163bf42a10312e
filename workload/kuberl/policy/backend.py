"""What a trainer backend is given to build its actor, and the builder's type: the contract between the
trainer (``kuberl.trainer.backends``, the table of builders by ``spec.trainer.backend``) and each backend
package (``kuberl.fsdp.backend``, ``kuberl.megatron.backend``). A builder sets up its parallel groups,
builds the actor (:class:`~kuberl.policy.actor.Actor`: its hooks are the backend's schedule, device
scope, reported stats and checkpoint format) and, for ``ppo``, its critic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..api.resolve import TrainerPlan
from ..api.spec import RLExperimentSpec
from .actor import Actor
from .algorithms import AlgorithmConfig
from .critic import Critic, CriticConfig


@dataclass(frozen=True)
class BackendInputs:
    """One rank's inputs. ``model``: the policy as loaded (on ``meta`` when ``weights`` names the
    directory of its files, which each rank then reads its pieces of); ``dtype``: the forward's and
    backward's compute dtype; ``critic``: ``ppo``'s value model's settings (None otherwise);
    ``hf_critic``: builds that critic as an FSDP2-sharded HF value model over every rank, from the
    unsharded policy (a backend may use it rather than build its own)."""

    spec: RLExperimentSpec
    plan: TrainerPlan
    model: torch.nn.Module
    device: torch.device
    weights: Path | None
    config: AlgorithmConfig
    dtype: torch.dtype
    critic: CriticConfig | None
    hf_critic: Callable[[], Critic]


ActorBuilder = Callable[[BackendInputs], Actor]
