"""Training progress: one type for trainer rank 0's ``GET /progress``, its termination message,
``RLExperiment.status.progress`` and ``kuberl run``'s display.

camelCase on the wire (snake_case names are accepted too). Every number is bounded and finite and
every float is rounded to 4 digits, so a status patch happens when training moved, not when a
float's last bit did. ``observed_staleness`` is the largest version lag of any sample trained so far;
the bound it never exceeds is the spec's ``rollout.maxStaleness`` (η).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, Strict, ValidationError

from .base import ApiModel

log = logging.getLogger("kuberl.api")

LARGEST = 10**15
MAX_CHECKPOINT_URI = 1024

Count = Annotated[int, Strict(), Field(ge=0, le=LARGEST)]
Number = Annotated[float, Strict(), Field(ge=-LARGEST, le=LARGEST, allow_inf_nan=False),
                   AfterValidator(lambda value: round(value, 4))]
TrainerPhase = Literal["starting", "running", "succeeded"]
PushMode = Literal["p2p", "p2p-relayed", "broadcast", "disk"]
TRANSPORTS: dict[str, str] = {  # what carries each mode's bytes (the p2p group is gloo over TCP, fed from a host copy)
    "p2p": "gloo over TCP", "p2p-relayed": "gloo over TCP", "broadcast": "HTTP", "disk": "a shared volume"}
SLOW_REPLICA_FACTOR = 2.0  # a replica this many times slower than the median of the others that took a push
MAX_REASON = 300
MAX_URL = 256


@dataclass(frozen=True)
class PoolReceipt:
    """What the inference pool's client saw of one weight update: each replica that took it (URL → seconds
    from the update's start until it served the version) and each that left rotation on the way (URL → why:
    it failed, or straggled past its peers)."""

    served: dict[str, float] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """Until the slowest replica that took it served it (0 when none did)."""
        return max(self.served.values(), default=0.0)


class WeightPush(ApiModel):
    """One weight exchange as trainer rank 0 saw it end: the way the version went — ``p2p`` (``p2p-relayed``
    when the replicas forwarded pieces to each other), ``broadcast`` or ``disk``; ``fellBack`` when p2p could
    not carry it and it went by broadcast, with the reason —, the bytes each replica received, the seconds until
    the slowest replica that took it served it, the rate (bytes per replica ÷ seconds), and the slowest replica
    against the median of the others that took it (none with one replica)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    version: Count = Field(description="the policy version pushed")
    mode: PushMode = Field(description="how it reached the replicas: p2p, p2p-relayed, broadcast or disk")
    transport: str | None = Field(None, max_length=64, description="what carried the bytes: gloo over TCP (p2p), "
                                  "HTTP (broadcast), a shared volume (disk)")
    fell_back: bool = Field(False, description="p2p could not carry it; it went by broadcast")
    reason: str | None = Field(None, max_length=MAX_REASON, description="why it fell back")
    bytes_per_replica: Count = Field(description="bytes each replica received")
    seconds: Number = Field(description="from the update's start until the slowest replica that took it served it")
    gigabytes_per_second: Number | None = Field(None, description="bytesPerReplica ÷ seconds, in GB/s")
    replicas: Count = Field(description="replicas that took it")
    replicas_lost: Count = Field(0, description="replicas that failed or straggled on the way and left rotation "
                                                "(they get the newest weights when they are back)")
    slowest_replica: str | None = Field(None, max_length=MAX_URL, description="the replica that took longest")
    slowest_ratio: Number | None = Field(None, description="its seconds ÷ the median of the others that took it "
                                                           "(≥ 2: a slow link or replica)")
    planned_port_bytes: Count | None = Field(None, description="p2p: the bytes the plan puts on its busiest network "
                                             "port (a relay's two stages added) — at a link rate R the exchange "
                                             "takes at least this ÷ R")
    port_gigabytes_per_second: Number | None = Field(None, description="plannedPortBytes ÷ seconds, in GB/s: the "
                                                     "rate the plan's busiest port achieved (compare with the link's)")

    @classmethod
    def of(cls, version: int, mode: PushMode, nbytes: int, receipt: PoolReceipt,
           fallback_reason: str | None = None, planned_port_bytes: int | None = None) -> WeightPush:
        """The account of a push of ``nbytes`` per replica from ``receipt``; ``fallback_reason``: why p2p could
        not carry it (it went by broadcast); ``planned_port_bytes``: the p2p plan's busiest port's bytes."""
        seconds = receipt.seconds
        slowest = max(receipt.served, key=receipt.served.__getitem__, default=None)
        others = [t for url, t in receipt.served.items() if url != slowest]
        median = statistics.median(others) if others else 0.0
        return cls(version=version, mode=mode, transport=TRANSPORTS[mode], fell_back=fallback_reason is not None,
                   reason=None if fallback_reason is None else fallback_reason[:MAX_REASON], bytes_per_replica=nbytes,
                   seconds=seconds, gigabytes_per_second=nbytes / seconds / 1e9 if seconds > 0 else None,
                   replicas=len(receipt.served), replicas_lost=len(receipt.lost),
                   slowest_replica=None if slowest is None or not others else slowest[:MAX_URL],
                   slowest_ratio=seconds / median if median > 0 else None, planned_port_bytes=planned_port_bytes,
                   port_gigabytes_per_second=planned_port_bytes / seconds / 1e9
                   if planned_port_bytes is not None and seconds > 0 else None)

    @property
    def slow_replica(self) -> bool:
        """A replica took ≥ :data:`SLOW_REPLICA_FACTOR` × the median of the others that took the push."""
        return self.slowest_ratio is not None and self.slowest_ratio >= SLOW_REPLICA_FACTOR


class Progress(ApiModel):
    """Where a run is. Every field may be missing (a trainer that has not reported it yet)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}  # a newer trainer's extra fields are not an error

    step: Count | None = Field(None, description="training steps done")
    first_step: Count | None = Field(None, description="the step this trainer process started from (a resume); "
                                                       "rates and ETAs count from here")
    max_steps: Count | None = Field(None, description="steps the run will train")
    version: Count | None = Field(None, description="policy version pushed to the pool (v = weights after v steps)")
    reward: Number | None = Field(None, description="mean reward of the last step's batch")
    reward_first10: Number | None = Field(None, description="mean reward of the first 10 steps")
    reward_last10: Number | None = Field(None, description="mean reward of the last 10 steps (compare: learning?)")
    observed_staleness: Count | None = Field(
        None, description="largest version lag of a sample trained so far (above rollout.maxStaleness only through "
                          "lateGroupsTrained)")
    late_groups_trained: Count | None = Field(
        None, description="groups trained staler than rollout.maxStaleness (long episodes overtaken by short ones; "
                          "rollout.lateGroups: train), with their importance weights")
    tokens_per_second: Number | None = Field(None, description="trained tokens per second of this process")
    step_seconds: Number | None = Field(None, description="wall seconds of the last step")
    weight_sync_seconds: Number | None = Field(None, description="the last weight exchange (it overlaps the next step)")
    behav_logp_gap: Number | None = Field(
        None, description="mean |log π_behaviour − log π_trainer| of tokens sampled by the weights being trained: "
                          "≈ 0 when the inference pool serves the trainer's policy; above 0.2 the trainer warns")
    entropy: Number | None = Field(None, description="the policy's mean token entropy in the last step")
    rollout_wait_fraction: Number | None = Field(
        None, description="share of the last 10 steps' seconds the trainer waited for rollouts (high: inference is "
                          "the bottleneck)")
    rollout_cpu_fraction: Number | None = Field(
        None, description="CPU seconds per second trainer rank 0's rollout process (episodes, HTTP, inline "
                          "rewards, evaluations, the gateway) used over the last 10 steps: CPU the trainer pod "
                          "needs beside its ranks; near 1, a core of its own")
    rollout_ready_groups: Count | None = Field(None, description="groups generated and waiting to be trained")
    staleness_budget_used: Number | None = Field(
        None, description="(accepted + running − version·B) ÷ ((maxStaleness + 1)·B) rollouts: 1 = generation is as "
                          "far ahead as rollout.maxStaleness allows (inference to spare), ≈ 0 = the trainer waits")
    phase: TrainerPhase | None = Field(None, description="the trainer's own phase")
    last_checkpoint: str | None = Field(None, max_length=MAX_CHECKPOINT_URI,
                                        description="the newest complete checkpoint's URI")
    prompts_trained: Count | None = Field(None, description="dataset prompts trained so far, each exactly once")
    prompts_reissued: Count | None = Field(
        None, description="prompts handed out again: their group was too stale, their episode failed, or a "
                          "restart found them pending in the checkpoint")
    prompts_skipped: Count | None = Field(
        None, description="prompts given up: an episode that failed 3 times, or a group dropped as too stale 20 "
                          "times (else 0)")
    reward_timeouts: Count | None = Field(None, description="reward calls past spec.reward.timeoutSeconds (scored 0)")
    reward_errors: Count | None = Field(None, description="reward calls that raised or returned no number (scored 0)")
    prompts_too_long: Count | None = Field(None, description="dataset rows skipped: prompt over "
                                                             "spec.dataset.maxPromptTokens")
    model_revision: str | None = Field(None, max_length=64, description="the hub commit an hf:// model resolved to")
    init_from: str | None = Field(None, max_length=1024, description="the weights the run started from "
                                                                    "(spec.model.initFrom)")
    last_export: str | None = Field(None, max_length=MAX_CHECKPOINT_URI,
                                    description="the newest Hugging Face export of the policy (spec.export)")
    eval_step: Count | None = Field(None, description="training steps before the last held-out evaluation (the "
                                                      "step it was due after)")
    eval_version: Count | None = Field(None, description="the policy version the last held-out evaluation measured "
                                                         "(the oldest of its tokens')")
    eval_version_span: Count | None = Field(None, description="how many policy versions wrote the last held-out "
                                                              "evaluation's tokens (1: one policy, as due)")
    eval_reward: Number | None = Field(None, description="mean reward of the last held-out evaluation")
    eval_pass_at_k: Number | None = Field(None, description="pass@k of the last held-out evaluation")
    last_push: WeightPush | None = Field(None, description="the last weight exchange, as it happened")
    pushes_fell_back: Count | None = Field(None, description="weight exchanges so far that p2p could not carry "
                                                             "(they went by broadcast)")
    pushes_slow_replica: Count | None = Field(None, description="weight exchanges so far in which a replica took ≥ 2× "
                                                                "the median of the others")

    @classmethod
    def from_reply(cls, payload: Any) -> Progress | None:
        """What a trainer answered (untrusted: ``/progress``, a termination message) → ``Progress``,
        each value that is not what its field allows left out; None unless ``payload`` is a mapping."""
        if not isinstance(payload, dict):
            return None
        return cls.model_validate(cls._allowed(payload, logging.DEBUG))

    def merged(self, **changes: Any) -> Progress:
        """This progress with ``changes`` (field names) applied; a value its field does not allow (a NaN
        reward) is left out with a warning, never raised into the training loop. A name that is no
        field is a programming error (KeyError)."""
        unknown = set(changes) - set(type(self).model_fields)
        if unknown:
            raise KeyError(f"Progress has no field {sorted(unknown)}")
        return type(self).model_validate({**self.model_dump(exclude_none=True),
                                          **type(self)._allowed(changes, logging.WARNING)})

    @classmethod
    def _allowed(cls, values: dict[str, Any], level: int) -> dict[str, Any]:
        """The items of ``values`` that validate on their own; the others logged at ``level``."""
        kept: dict[str, Any] = {}
        for key, value in values.items():
            try:
                cls.model_validate({key: value})
            except ValidationError as err:
                log.log(level, "progress value %.40r of %.40r left out: %s", value, key, err.errors()[0]["msg"])
                continue
            kept[key] = value
        return kept
