"""The policy step every backend takes: one decoupled-PPO update from a batch, written once.

A step, for a batch of trajectories already split across data-parallel ranks:

1. proximal log-probs: log π_prox(token) with the weights at the start of the step, no grad;
2. the batch is split into ``mini_batches`` equal parts, one optimizer update each; within a part,
   micro-batches by token budget accumulate gradients of the decoupled PPO loss normalised by the
   part's *global* token count ÷ data-parallel ranks (gradients are averaged over those ranks, so
   the sum is the global mean);
3. gradient clipping, the optimizer's step.

Every step also measures ``ppo_actor/entropy``, the policy's mean token entropy over the trained
tokens of all ranks (nats; its fall to 0 is the usual sign of a collapsing policy), and
``mismatch/behav_logp_gap`` = mean |log π_prox − log π_behav| over the
tokens the engine sampled with the very weights being trained (``Batch.fresh_mask``), over all
ranks: ≈ 0 when the inference engine serves the trainer's policy (see :func:`.loss.behaviour_gap`).

With one update per batch (``mini_batches = 1``, the default) the weights cannot change between
step 1 and the loss, so π_prox = sg(π_θ) exactly and the extra forward pass of step 1 is skipped.

With a ``critic`` (``ppo``) the rows' advantages are replaced, before step 1, by GAE's per-token
advantages from the critic's values (:mod:`.critic`), and each optimizer update of the policy is
followed by one of the critic, on the same micro-batches, towards the returns.

With ``kl_coef > 0`` the actor also holds a frozen reference policy π_ref, never updated after
``freeze_reference()`` (the trainer calls it once, when RL starts); each micro-batch then costs one
more forward pass, for log π_ref.

Backends are siblings below this module (verl's ``dp_actor`` / ``megatron_actor``): the FSDP2 actor
(:mod:`kuberl.fsdp.actor`) and the Megatron-core actor (:mod:`kuberl.megatron.actor`) implement how a
model is read (``scorer``) and scheduled (``forward_backward``: chunk after chunk, or a pipeline's 1F1B),
clipped, split over data-parallel ranks, checkpointed and gathered — the abstract hooks of :class:`Actor`.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..api.lora import LoraSpec
from ..collectives import all_reduce, all_reduce_many, world_size
from ..data.datasets import Example
from ..models.moe_routing import replaying
from ..models.text import TextCodec
from ..weights.layouts import ParamMeta
from ..weights.p2p import WeightSource
from ..weights.plan import Holding
from ..weights.transport import local_tensor, whole_tensor
from .algorithms import AlgorithmConfig
from .batch import TOKEN_BUDGET, Batch, micro_batch_count, split
from .critic import Critic, ValueTargets
from .loss import SUMMED_STATS, VALID_TOKENS, behaviour_gap, loss_normalizer, ppo_loss
from .packing import pack
from .update_size import PROBE_ROWS, UpdateNormer, relative_size, update_kl_sums
from .update_size import update_norms as adamw_update_norms

TOKEN_SUMS = ("gap/sum", "gap/tokens", "entropy/sum", "entropy/tokens")
"""Per-rank sums that :meth:`Actor.train_step` adds up over updates and ranks before dividing."""


def host_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim device tensors → Python floats in one device-to-host copy (one sync per step, not one
    per number). Tensors without data (the ``meta`` device, in placement tests) become NaN."""
    if not values:
        return {}
    stacked = torch.stack([v.detach().float().reshape(()) for v in values.values()])
    numbers = [math.nan] * len(values) if stacked.is_meta else stacked.cpu().tolist()
    return dict(zip(values, numbers, strict=True))


def _log_policy(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """log π(v) for every vocabulary entry at every position, [B, L−1, V], under the
    temperature-scaled policy the engine samples from (a mixture of experts routed as the engine
    routed, where the batch carries its routes)."""
    with replaying(model, batch.routes):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return scaled_log_softmax(logits, temperature)


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) in float32 (temperature 0: greedy sampling, logits as they are)."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """log π(target) at every position, under the temperature-scaled policy (as the engine samples)."""
    return _log_policy(model, batch, temperature).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def _target_logprobs_and_entropy(logp_all: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def token_logprobs_and_entropy(model: torch.nn.Module, batch: Batch,
                               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), H(π)) at every position; H = −Σ_v π(v) log π(v) over the vocabulary, detached
    (a diagnostic, not a loss term)."""
    return _target_logprobs_and_entropy(_log_policy(model, batch, temperature), batch.targets)


def packed_token_logprobs_and_entropy(model: torch.nn.Module, batch: Batch,
                                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs_and_entropy`` with the batch's rows packed (:mod:`.packing`): the same values
    in the same [B, L−1] layout, zero at padding, from bins × width tokens of compute."""
    packing = pack(batch)
    # No attention mask and no cache: transformers then reads sequence starts from the position ids.
    with replaying(model, packing.routes):
        logits = model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False).logits[:, :-1]
    logp, entropy = _target_logprobs_and_entropy(scaled_log_softmax(logits, temperature), packing.input_ids[:, 1:])
    return packing.unpack(logp), packing.unpack(entropy)


Scorer = Callable[[torch.nn.Module, Batch, float], tuple[torch.Tensor, torch.Tensor]]
"""(model, batch, temperature) → (log π(target), H(π)) per position: how a backend reads its model."""
GradientClipper = Callable[[list[torch.nn.Parameter], float], torch.Tensor]
"""(parameters, max norm) → the global gradient norm before clipping; clips in place."""
ChunkReader = Callable[[int, Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""(index, chunk, log π(target), H(π)) → (the chunk's loss, what to keep of it): what a schedule does
with each chunk's scores."""


def plain_loop(scorer: Scorer, temperature: float, model: torch.nn.Module, chunks: list[Batch],
               on_scores: ChunkReader, forward_only: bool) -> list[Any]:
    """The schedule of a model held whole on every rank of its data-parallel group: each chunk
    forward (``scorer``), ``on_scores``, then, unless ``forward_only``, its loss's backward (gradients
    add up in the parameters); what ``on_scores`` kept of each chunk, in order."""
    kept = []
    for i, chunk in enumerate(chunks):
        loss, keep = on_scores(i, chunk, *scorer(model, chunk, temperature))
        if not forward_only:
            loss.backward()
        kept.append(keep)
    return kept


def batch_stats(chunk_stats: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One update's stats from its micro-batches' (tensors where they were computed: no host sync):
    :data:`TOKEN_SUMS` and :data:`.loss.SUMMED_STATS` added up, the others (per-token means) as
    Σ mean · valid tokens / Σ valid tokens. (A pipeline stage without the loss has empty dicts.)"""
    summed: dict[str, torch.Tensor] = {}
    weighted: dict[str, torch.Tensor] = {}  # Σ mean · valid tokens
    for chunk in chunk_stats:
        for k, v in chunk.items():
            if k in TOKEN_SUMS or k in SUMMED_STATS:
                summed[k] = summed.get(k, 0.0) + v
            else:
                weighted[k] = weighted.get(k, 0.0) + v * chunk[VALID_TOKENS]
    return summed | {k: v / summed[VALID_TOKENS].clamp(min=1.0) for k, v in weighted.items()}


@dataclass
class Actor(ABC):
    """The decoupled-PPO step of every backend. A backend sets ``scorer``, ``clip_gradients`` and ``update_norms``
    and implements the abstract hooks below, overriding nothing else (FSDP2:
    :class:`kuberl.fsdp.actor.FSDPActor`; Megatron: :class:`kuberl.megatron.actor.MegatronActor`;
    ``tests/test_backends.py`` holds them to it). Its builder is in :mod:`kuberl.trainer.backends`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: AlgorithmConfig
    temperature: float
    mini_batches: int = 1
    token_budget: int = TOKEN_BUDGET
    max_grad_norm: float = 1.0
    reference: torch.nn.Module | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    scorer: Scorer = token_logprobs_and_entropy
    clip_gradients: GradientClipper = torch.nn.utils.clip_grad_norm_
    update_norms: UpdateNormer = adamw_update_norms  # (‖Δθ‖, ‖θ‖) of the last optimizer step over every rank's pieces
    packing: bool = False  # the scorer packs each micro-batch's rows (set with the packed scorer)
    critic: Critic | None = None  # ppo's value model: GAE advantages per token, trained in the same step
    adapter: LoraSpec | None = None  # spec.trainer.lora: the model carries a LoRA adapter, the only weights trained

    def __post_init__(self) -> None:
        if self.config.name == "ppo" and self.critic is None:
            raise ValueError("algorithm.name ppo needs a critic: this backend built none")
        if self.critic is not None and self.config.loss_agg != "token_mean":
            raise ValueError(f"a critic's loss is a token mean; the policy's is {self.config.loss_agg}")

    def set_learning_rate(self, lr: float, share: float = 1.0) -> None:
        """The learning rate of the next updates (the trainer sets it every step from its schedule);
        a critic's is its own base rate × ``share``, the schedule's share of the policy's base rate."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.critic is not None:
            self.critic.set_learning_rate(share)

    def freeze_reference(self) -> None:
        """π_ref := the current policy (both are sharded alike, so each rank copies its own shards)."""
        if self.reference is None:
            return
        with torch.no_grad():
            for ref, param in zip(self.reference.parameters(), self.model.parameters(), strict=True):
                local_tensor(ref).copy_(local_tensor(param))

    def start_critic(self) -> None:
        """The critic's transformer := the policy's as it is now (after the SFT warm-up; the trainer
        calls it once, when RL starts); its head keeps starting at zero. Every rank calls it."""
        if self.critic is not None:
            self.critic.start_from(self.full_state_dict())

    def _micro_batches(self, part: Batch) -> list[Batch]:
        """Rows of like length together, each micro-batch trimmed to its longest row, within the
        token budget (``micro_batch_count``; packed or not: packing then fits each micro-batch's rows in
        fewer rows, :mod:`.packing`); the same number of micro-batches on every rank."""
        count = int(all_reduce(micro_batch_count(part, self.token_budget), dist.ReduceOp.MAX))
        return [chunk.trimmed() for chunk in split(part.by_length(), count)]

    def train_step(self, batch: Batch, global_rows: int) -> dict[str, float]:
        """One batch (host memory; moved to ``device`` micro-batch by micro-batch): ``mini_batches``
        optimizer updates; stats are averaged over the updates, but ``mismatch/*`` covers the whole
        batch of every rank. Runs inside the backend's :meth:`compute_scope`."""
        with self.compute_scope():
            return self._train_step(batch, global_rows)

    def _train_step(self, batch: Batch, global_rows: int) -> dict[str, float]:
        start = time.perf_counter()
        parts = split(batch, self.mini_batches)
        host_chunks = [self._micro_batches(part) for part in parts]
        chunks = [[c.to(self.device) for c in part] for part in host_chunks]
        probe = host_chunks[0][0].select(slice(0, PROBE_ROWS)).trimmed().to(self.device)
        part_tokens = [float(part.loss_mask.sum()) for part in parts]  # counted on the host copy
        prox: list[list[torch.Tensor] | None] = [None] * len(parts)
        if self.mini_batches > 1:
            prox = [self.logprobs(self.model, part) for part in chunks]
        targets: list[list[ValueTargets] | None] = [None] * len(parts)
        if self.critic is not None:
            chunks, targets = self.critic.advantages(chunks)  # type: ignore[assignment]
        stats: dict[str, float] = {}
        sums = dict.fromkeys(TOKEN_SUMS, 0.0)
        first_logp: list[torch.Tensor] = list(prox[0][:1]) if prox[0] is not None else []
        for part_chunks, part_prox, part_targets, tokens in zip(chunks, prox, targets, part_tokens, strict=True):
            part_stats = self._update(part_chunks, part_prox, global_rows / len(parts), tokens, part_targets,
                                      first_logp)
            for k, v in part_stats.items():
                if k in sums:
                    sums[k] += v
                else:
                    stats[k] = stats.get(k, 0.0) + v / len(parts)
        gap_sum, fresh_tokens, entropy_sum, loss_tokens = all_reduce_many([sums[k] for k in TOKEN_SUMS])
        stats["mismatch/fresh_tokens"] = fresh_tokens
        stats["mismatch/behav_logp_gap"] = gap_sum / fresh_tokens if fresh_tokens else float("nan")
        stats["ppo_actor/entropy"] = entropy_sum / loss_tokens if loss_tokens else float("nan")
        stats["ppo_actor/update_kl"] = self._update_kl(probe, first_logp)
        stats["timeperf/train_step"] = time.perf_counter() - start
        return stats

    def _update_kl(self, probe: Batch, before: list[torch.Tensor]) -> float:
        """KL(π_new ‖ π_old) per token (:mod:`.update_size`) on ``probe``, the first :data:`PROBE_ROWS` rows of
        the step's first micro-batch; ``before``: that micro-batch's log-probs at the step's start (empty
        where this rank computes no loss). One forward pass of the probe; the sums added over every rank."""
        after = self.logprobs(self.model, [probe])
        if after:
            rows, width = probe.targets.shape  # right padding under a causal mask: the first columns' values
            local = update_kl_sums(before[0][:rows, :width], after[0], probe.loss_mask)
        else:
            local = torch.zeros(2, device=self.device)
        kl_sum, tokens = all_reduce_many([math.nan] * 2 if local.is_meta else local.tolist())
        return kl_sum / tokens if tokens else float("nan")

    def logprobs(self, model: torch.nn.Module, chunks: list[Batch]) -> list[torch.Tensor]:
        """log π(target) of ``model`` (the policy before an update, or π_ref) for each chunk, no grad,
        through the backend's schedule (where it holds the loss: an empty list on a pipeline stage that
        does not)."""

        def keep_logprobs(_: int, chunk: Batch, logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return torch.zeros(()), logp

        with torch.no_grad():
            return self.forward_backward(model, chunks, keep_logprobs, forward_only=True)

    def _update(self, chunks: list[Batch], prox: list[torch.Tensor] | None, global_rows: float,
                local_tokens: float, targets: list[ValueTargets] | None = None,
                first_logp: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Accumulate the loss gradient over ``chunks`` (on ``device``; π_prox = sg(π_θ) when ``prox``
        is None), then step; with a critic, then its step towards ``targets``. ``local_tokens``: this
        rank's loss tokens in ``chunks``. The stats (each chunk's weighted by its rows) include this
        rank's sums in :data:`TOKEN_SUMS`. An empty ``first_logp`` receives the first chunk's log-probs
        (the policy before this update) where this rank computes them."""
        _, data_ranks = self.data_parallel()
        # N over every rank's rows and tokens (ranks that share rows count them alike), ÷ the data-parallel
        # ranks: their gradients are averaged, so the sum is the global mean
        normalizer = loss_normalizer(self.config, global_rows,
                                     lambda: all_reduce(local_tokens) * data_ranks / world_size()) / data_ranks
        self.optimizer.zero_grad(set_to_none=True)
        stats = batch_stats(self.accumulate_gradients(chunks, prox, normalizer, first_logp))
        grad_norm = self.clip_gradients(list(self.model.parameters()), self.max_grad_norm)
        self.optimizer.step()
        stats["ppo_actor/grad_norm"] = whole_tensor(grad_norm)
        stats["ppo_actor/update_size"] = relative_size(*self.update_norms(self.optimizer))
        if self.critic is not None and targets is not None:
            stats |= self.critic.update(chunks, targets, normalizer)
        return self.as_reported(host_floats(stats))

    def accumulate_gradients(self, chunks: list[Batch], prox: list[torch.Tensor] | None, normalizer: float,
                             first_logp: list[torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
        """The loss's backward for each chunk through the backend's schedule (gradients add up); each
        chunk's stats (empty dicts where a rank holds no loss: a pipeline stage before the last). An empty
        ``first_logp`` receives the first chunk's log-probs, detached."""
        ref = self.logprobs(self.reference, chunks) if self.reference is not None else None

        def loss(i: int, chunk: Batch, logp: torch.Tensor,
                 entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            if i == 0 and first_logp is not None and not first_logp:
                first_logp.append(logp.detach())
            return self.chunk_loss(chunk, logp, entropy, None if prox is None else prox[i],
                                   None if ref is None else ref[i], normalizer)

        return self.forward_backward(self.model, chunks, loss, forward_only=False) or [{} for _ in chunks]

    def chunk_loss(self, chunk: Batch, logp: torch.Tensor, entropy: torch.Tensor, prox_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decoupled-PPO loss of one chunk (:func:`.loss.ppo_loss`; π_prox = sg(π_θ) when
        ``prox_logp`` is None) and its stats: the loss's, and the sums :data:`TOKEN_SUMS` —
        :func:`.loss.behaviour_gap` as ``gap/sum`` and ``gap/tokens``, Σ mask · H as ``entropy/sum``
        over ``entropy/tokens``."""
        prox_logp = logp.detach() if prox_logp is None else prox_logp
        gap = behaviour_gap(prox_logp, chunk.behav_logp, chunk.fresh_mask * chunk.loss_mask)
        out = ppo_loss(logp, prox_logp, chunk.behav_logp, chunk.advantages, chunk.loss_mask, self.config,
                       ref_logp=ref_logp, normalizer=normalizer)
        sums = {"gap/sum": gap[0], "gap/tokens": gap[1], "entropy/sum": (entropy * chunk.loss_mask).sum(),
                "entropy/tokens": chunk.loss_mask.sum()}
        return out.loss, {**out.stats, **sums}

    # The backend's hooks: every one is abstract, so a backend reads as the list of what it decides.

    @abstractmethod
    def forward_backward(self, model: torch.nn.Module, chunks: list[Batch], on_scores: ChunkReader,
                         forward_only: bool) -> list[Any]:
        """The schedule: every chunk through ``model`` (``scorer``), ``on_scores`` on its scores, and unless
        ``forward_only`` the loss's backward; what ``on_scores`` kept of each chunk where this rank
        computes the loss, an empty list where it does not (:func:`plain_loop`, or a pipeline's)."""
        raise NotImplementedError

    @abstractmethod
    def compute_scope(self) -> AbstractContextManager[Any]:
        """What a step runs inside (e.g. a library's device shim); ``contextlib.nullcontext()`` for none."""
        raise NotImplementedError

    @abstractmethod
    def as_reported(self, stats: dict[str, float]) -> dict[str, float]:
        """An update's stats as every rank reports them: where only some ranks compute the loss (a
        pipeline's last stage), theirs — but this rank's own :data:`TOKEN_SUMS`."""
        raise NotImplementedError

    @abstractmethod
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's index, how many) among the ranks that split a batch's rows."""
        raise NotImplementedError

    @abstractmethod
    def save_shards(self, directory: Path) -> None:
        """Every rank writes its part of the model, optimizer and reference into ``directory``."""
        raise NotImplementedError

    @abstractmethod
    def load_shards(self, directory: Path) -> None:
        """Every rank reads its part back from what :meth:`save_shards` wrote."""
        raise NotImplementedError

    @property
    @abstractmethod
    def checkpoint_layout(self) -> dict[str, str | int]:
        """What a resume must share with the run that saved."""
        raise NotImplementedError

    @abstractmethod
    def supervised_warm_up(self, codec: TextCodec, data: Iterator[Example], steps: int,
                           batch_size: int, lr: float) -> list[float]:
        """``spec.model.sftWarmup``: the losses of ``steps`` supervised steps."""
        raise NotImplementedError

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded HF-named weights on rank 0 (an empty dict on other ranks); every rank must call it."""
        raise NotImplementedError

    @abstractmethod
    def weight_source(self) -> WeightSource:
        """What the weight exchange sends after each step: the whole policy (the actor itself), or
        only what the replicas lack (an adapter)."""
        raise NotImplementedError

    def critic_state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's unsharded HF-named weights on rank 0 (an empty dict elsewhere, and without a
        critic); every rank must call it."""
        return {} if self.critic is None else self.critic.full_state_dict()

    @abstractmethod
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, as this backend holds it."""
        raise NotImplementedError

    @abstractmethod
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter."""
        raise NotImplementedError

    @abstractmethod
    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        """Which rank holds which piece of each weight (the weight exchange's plan reads it)."""
        raise NotImplementedError
