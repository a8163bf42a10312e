"""What rollout produces and the trainer consumes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class Trajectory:
    """One episode: prompt + output tokens, behaviour log-probs, per-token versions and a per-token
    ``loss_mask`` (1: the policy wrote it and it is trained on; 0: context, e.g. a tool's output or a
    user turn inside a multi-turn episode; None: every output token is the policy's). Context tokens
    carry log-prob 0 and the version of the policy token before them. ``routes``: a mixture of experts'
    routes as the engine chose them (:mod:`kuberl.models.moe_routing`), [prompt + output − 1 positions,
    MoE layers, k], when it was asked for them."""

    prompt_ids: list[int]
    output_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    group: int = 0
    finish_reason: str = "stop"
    info: dict[str, str] = field(default_factory=dict)
    loss_mask: list[int] | None = None
    routes: torch.Tensor | None = None

    @property
    def trained(self) -> list[int]:
        """The per-token loss mask (all ones unless set)."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.output_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)

    @property
    def trained_versions(self) -> list[int]:
        """The version of each trained token (the ones staleness is about)."""
        return [v for v, m in zip(self.versions, self.trained, strict=True) if m]

    @property
    def oldest_version(self) -> int:
        """The version of the oldest policy that wrote a trained token (staleness is measured from here)."""
        versions = self.trained_versions or self.versions
        return min(versions) if versions else 0

    def __post_init__(self) -> None:
        lengths = {len(self.output_ids), len(self.behav_logprobs), len(self.versions)}
        if self.loss_mask is not None:
            lengths.add(len(self.loss_mask))
        if len(lengths) != 1:
            raise ValueError("output_ids, behav_logprobs, versions and loss_mask must have the same length")
        positions = len(self.prompt_ids) + len(self.output_ids) - 1
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != positions):
            raise ValueError(f"routes must be [{positions} positions, layers, k]; got {tuple(self.routes.shape)}")


class Versioned(Protocol):
    """A trajectory, or a group of them: the version of the oldest policy that wrote a trained token."""

    @property
    def oldest_version(self) -> int: ...


def version_lag(version: int, items: Iterable[Versioned]) -> int:
    """The largest version lag among ``items`` (trajectories or groups) trained at ``version``: max over
    them of version − ``oldest_version`` (0 for none) — what the staleness bound η caps."""
    return max((version - item.oldest_version for item in items), default=0)


@dataclass
class Group:
    """The G trajectories of one prompt, rewarded; the unit of admission and of advantages."""

    trajectories: list[Trajectory]
    prompt: int | None = None  # its prompt's place in the dataset stream (kuberl.rollout.ledger); None: an agent's
    sample_span: tuple[int, int] | None = None  # its traced ``sample`` span (trace id, span id): the step links to it

    @functools.cached_property
    def oldest_version(self) -> int:
        """Computed once (a group's trajectories do not change once it is built): the buffer asks it of
        every waiting group at every take."""
        return min(t.oldest_version for t in self.trajectories)
