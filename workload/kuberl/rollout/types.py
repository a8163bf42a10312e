"""What rollout produces and the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One sampled completion: prompt + output tokens, behaviour log-probs, per-token versions."""

    prompt_ids: list[int]
    output_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    group: int = 0
    finish_reason: str = "stop"
    info: dict[str, str] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        """The version of the oldest policy that wrote any token of it (staleness is measured from here)."""
        return min(self.versions) if self.versions else 0

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.behav_logprobs) == len(self.versions)):
            raise ValueError("output_ids, behav_logprobs and versions must have the same length")


@dataclass
class Group:
    """The G trajectories of one prompt, rewarded; the unit of admission and of advantages."""

    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.trajectories)
