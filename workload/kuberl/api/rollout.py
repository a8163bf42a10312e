"""How episodes are generated (``spec.rollout``): the staleness bound and what becomes of a late group,
concurrency, sampling, tools and the episode workflow."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from .base import ApiModel, Positive
from .rewards import IMPORT_PATH_PATTERN


class ToolName(StrEnum):
    CALCULATOR = "calculator"
    PYTHON = "python"


class LateGroups(StrEnum):
    """What becomes of a group staler than η when the trainer takes it (``kuberl.rollout.buffer``)."""

    TRAIN = "train"  # trained with its behaviour importance weights (AReaL's rule)
    DROP = "drop"  # dropped, its prompt re-issued: nothing staler than η is trained


class RolloutSpec(ApiModel):
    """How episodes are generated: staleness bound, concurrency, sampling, tools, and the episode workflow."""

    max_staleness: int = Field(4, ge=0, description="η: a rollout starts only while the episodes accepted and "
                                                    "running fit in η + 1 training batches ahead of the policy "
                                                    "version, so an episode trained in turn is at most η versions "
                                                    "old; 0 is synchronous RL")
    late_groups: LateGroups = Field(
        LateGroups.TRAIN, description="a group staler than η when trained (a long episode overtaken by short "
                                      "ones): train — with its behaviour importance weights (algorithm."
                                      "importanceSampling), its staleness reported; drop — and re-issue its "
                                      "prompt, so nothing staler than η is trained, at the price of training "
                                      "on shorter episodes than rollout makes when lengths are long-tailed")
    max_concurrent: Positive = Field(512, description="samples generated at once across the pool (in whole groups: "
                                                      "⌊maxConcurrent ÷ groupSize⌋ groups), besides the staleness "
                                                      "bound")
    max_new_tokens: Positive = Field(1024, description="per episode (all turns together)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the rollout (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens whose "
                                                      "probabilities add up to topP (1: all)")
    tools: list[ToolName] = Field(
        default_factory=list, max_length=4,
        description="tools the policy may call (kuberl.agent.tools): episodes become multi-turn, tool output is "
                    "context, never trained on")
    max_turns: int = Field(4, ge=1, le=16, description="model turns per episode when tools are given")
    workflow: str | None = Field(
        None, pattern=IMPORT_PATH_PATTERN, max_length=256,
        description="your episode logic, 'package.module:Name': Name(context) (a kuberl.rollout.workflow."
                    "WorkflowContext) returns an object with async run_episode(client, example, group_id) -> "
                    "Group | None, used for training and evaluation; default: KubeRL's (single-turn, or "
                    "multi-turn with spec.rollout.tools)")
