"""PPO's learned critic, for every backend: the value model, GAE and the clipped value loss.

Values. V at position p is a scalar head on the transformer's last hidden state there, read at the
positions that predict each generated token — [B, L−1], the loss mask's coordinates — so V_t is the
value of the state *before* token t is written.

Rewards. A trajectory's reward r sits on its last trained token, 0 on the others (an outcome
reward). The KL to π_ref stays a loss term (``algorithm.klCoef``), not a reward.

GAE (Schulman et al., 2016), over each row's trained tokens t₁ … tₙ in order (tool output between
turns is context, not a step):

    δₖ = rₖ + γ · Vₖ₊₁ − Vₖ            (Vₙ₊₁ = 0: the episode ends)
    Aₖ = δₖ + γλ · Aₖ₊₁  = Σ_{j≥k} (γλ)^{j−k} δⱼ
    Rₖ = Aₖ + Vₖ                        (the value target)

then the advantages are whitened over every trained token of the batch, on all ranks:
A ← (A − mean) / (std + 1e-6).

Value loss (PPO's clipped form), over the trained tokens, with V_old the values before this step's
updates:

    ℓ_v = ½ · max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)

normalised as the policy's token-mean loss is (Σ over the global batch's trained tokens). The
values are computed by the trainer when it trains (not by the engine that sampled), so staleness
changes nothing here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..collectives import all_reduce_many
from ..weights.transport import whole_tensor
from .batch import Batch
from .packing import pack

WHITEN_EPS = 1e-6
VALUE_HEAD = "score."
"""The value head's parameters (``*ForTokenClassification``'s ``score``): what the policy's files lack."""


@dataclass(frozen=True)
class CriticConfig:
    """``spec.algorithm.critic`` as the trainer uses it."""

    learning_rate: float = 1.0e-5
    gamma: float = 1.0
    gae_lambda: float = 1.0
    value_clip: float | None = 0.2


def value_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The critic of ``policy`` (an HF causal LM): its architecture's ``ForTokenClassification`` with one
    label and no dropout (an HF value model: ``AutoModelForTokenClassification`` loads its export), the
    transformer a copy of the policy's, the head zero (every value starts at 0). A policy on the
    ``meta`` device gives a critic there too, to be filled from the policy's files
    (:func:`kuberl.models.meta.materialize` with ``zeros=(VALUE_HEAD,)``)."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    on_meta = any(p.is_meta for p in policy.parameters())
    with torch.device("meta" if on_meta else "cpu"):
        critic = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    critic.config.architectures = [type(critic).__name__]  # its export loads as what it is
    if not on_meta:
        critic.base_model.load_state_dict(policy.base_model.state_dict())
        with torch.no_grad():
            for name, param in critic.named_parameters():
                if name.startswith(VALUE_HEAD):
                    param.zero_()
    return critic


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's reward on its last trained token (``mask`` 1), 0 elsewhere and on rows
    without a trained token."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(dim=1)
    placed = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.nonzero(last >= 0).squeeze(1)
    placed[rows, last[rows]] = rewards[rows].to(placed.dtype)
    return placed


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, T] each, 0 where ``mask`` is 0 — GAE over each row's trained tokens
    (module docstring), from ``values`` [B, T], the rows' ``rewards`` [B] and ``mask`` [B, T]: each
    row's trained tokens moved to its front in order, δ there, then A = the γλ-discounted sum of δ from
    the end (:func:`discounted_suffix_sums`), put back in place."""
    values, mask = values.detach().float(), mask.float()
    order = torch.argsort((mask <= 0).to(torch.int8), dim=1, stable=True)  # trained tokens first, in order
    kept = mask.gather(1, order)
    steps = values.gather(1, order) * kept
    following = torch.nn.functional.pad(steps[:, 1:], (0, 1))  # Vₖ₊₁, 0 after a row's last step
    deltas = (token_rewards(rewards, kept) + gamma * following - steps) * kept
    advantages = torch.zeros_like(values).scatter(1, order, discounted_suffix_sums(deltas, gamma * lam) * kept)
    return advantages, (advantages + values) * mask


GAE_BLOCK = 128
"""Positions :func:`discounted_suffix_sums` takes at once (one [B, n] × [n, n] product each)."""


def discounted_suffix_sums(x: torch.Tensor, c: float, block: int = GAE_BLOCK) -> torch.Tensor:
    """yₜ = Σ_{j≥t} c^{j−t} xⱼ along the last dimension: per block of positions from the end, a product
    with the block's [i, j] ↦ c^{j−i} (j ≥ i) matrix, plus c^{n−i} times the next block's first sum —
    T ÷ ``block`` steps instead of T (a per-position loop launched ~8 kernels per token)."""
    positions = torch.arange(block, device=x.device)
    gaps = positions[None, :] - positions[:, None]
    base = torch.tensor(float(c), device=x.device, dtype=x.dtype)
    within = torch.where(gaps >= 0, torch.pow(base, gaps.clamp(min=0).to(x.dtype)), 0.0)
    out = torch.empty_like(x)
    carry = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
    for start in reversed(range(0, x.shape[1], block)):
        part = x[:, start:start + block]
        n = part.shape[1]
        tail = torch.pow(base, (n - positions[:n]).to(x.dtype))
        sums = part @ within[:n, :n].T + carry[:, None] * tail
        out[:, start:start + n] = sums
        carry = sums[:, 0]
    return out


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """(A − mean) / (std + ε) with mean and std over every masked entry of every tensor on every rank
    (0 stays 0 off the mask)."""
    device = advantages[0].device
    zero = torch.zeros((), device=device)
    total = sum(((a * m).sum() for a, m in zip(advantages, masks, strict=True)), zero)
    squares = sum(((a.square() * m).sum() for a, m in zip(advantages, masks, strict=True)), zero)
    count = sum((m.sum() for m in masks), zero)
    total, squares, count = all_reduce_many([float(total), float(squares), float(count)])
    mean = total / max(count, 1.0)
    std = max(squares / max(count, 1.0) - mean * mean, 0.0) ** 0.5
    return [(a - mean) / (std + WHITEN_EPS) * m for a, m in zip(advantages, masks, strict=True)]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ mask · ℓ_v / ``normalizer`` (module docstring) and its stats: ``critic/value_loss`` (summed
    over micro-batches), and the means over the masked tokens of V, R and the share of tokens whose
    clipped term was the larger (``critic/clip_fraction``)."""
    squared = (values - returns).square()
    if clip is None:
        per_token, clipped = squared, torch.zeros_like(squared)
    else:
        kept = old_values + (values - old_values).clamp(-clip, clip)
        squared_clipped = (kept - returns).square()
        per_token = torch.maximum(squared, squared_clipped)
        clipped = (squared_clipped > squared).float()
    loss = 0.5 * (per_token * mask).sum() / normalizer
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        stats = {"critic/value_loss": loss.detach(), "critic/values": (values * mask).sum() / tokens,
                 "critic/returns": (returns * mask).sum() / tokens,
                 "critic/clip_fraction": (clipped * mask).sum() / tokens, "critic/tokens": mask.sum()}
    return loss, stats


def padded_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """V at every position that predicts a target, [B, L−1] (float32)."""
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, 0].float()


def packed_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """:func:`padded_values` from the batch's rows packed (:mod:`.packing`), in the same layout."""
    packing = pack(batch)
    out = model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False)
    return packing.unpack(out.logits[:, :-1, 0].float())


@dataclass
class ValueTargets:
    """What one micro-batch's value loss compares against: V_old and R, [b, l−1]."""

    old_values: torch.Tensor
    returns: torch.Tensor


@dataclass
class Critic:
    """The value model and its optimizer. Both backends train an FSDP2-sharded HF value model over
    every rank (:func:`kuberl.fsdp.actor.build_critic`): the critic does not need the policy's
    layout, and a Megatron policy's tensor- or pipeline-parallel ranks, which hold the same rows,
    each read the same values and average the same gradients (the token-mean normaliser is the same).
    Checkpointed with ``torch.distributed.checkpoint``, which re-shards over any number of ranks."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: CriticConfig
    read_values: Callable[[torch.nn.Module, Batch], torch.Tensor] = padded_values
    clip_gradients: Callable[[list[torch.nn.Parameter], float], torch.Tensor] = torch.nn.utils.clip_grad_norm_
    max_grad_norm: float = 1.0

    def save(self, directory: Path) -> None:
        """Every rank writes its shards of the value model and its optimizer into ``directory``."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))

    def load(self, directory: Path) -> None:
        """Every rank reads its shards back from what :meth:`save` wrote, over any number of ranks."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def start_from(self, policy_state: dict[str, torch.Tensor]) -> None:
        """The value model's transformer := the policy's in ``policy_state`` (whole HF-named tensors on
        rank 0, an empty dict elsewhere; every rank calls it), the head as it is."""
        backbone = {k: v for k, v in policy_state.items() if not k.startswith(("lm_head.", VALUE_HEAD))}
        set_model_state_dict(self.model, backbone, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The value model's unsharded HF-named weights on rank 0 (empty elsewhere); every rank calls it."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def set_learning_rate(self, scale: float) -> None:
        """``scale`` × the critic's learning rate (the policy's schedule, as a share of its base rate)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate * scale

    def advantages(self, parts: list[list[Batch]]) -> tuple[list[list[Batch]], list[list[ValueTargets]]]:
        """Every micro-batch of every part with GAE's whitened per-token advantages in place of its
        rows' scores, and the targets of its value loss; the values are read once, before any update."""
        flat = [chunk for part in parts for chunk in part]
        with torch.no_grad():
            values = [self.read_values(self.model, chunk) for chunk in flat]
        estimates = [gae(v, c.rewards, c.loss_mask, self.config.gamma, self.config.gae_lambda)
                     for v, c in zip(values, flat, strict=True)]
        whitened = iter(whiten([a for a, _ in estimates], [c.loss_mask for c in flat]))
        targets = iter([ValueTargets(v, r) for v, (_, r) in zip(values, estimates, strict=True)])
        return ([[replace(c, advantages=next(whitened)) for c in part] for part in parts],
                [[next(targets) for _ in part] for part in parts])

    def update(self, chunks: list[Batch], targets: list[ValueTargets], normalizer: float) -> dict[str, torch.Tensor]:
        """One optimizer step of the value loss over ``chunks`` (gradients accumulated); its stats (the
        per-token means weighted by each chunk's tokens) and ``critic/grad_norm``."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for chunk, target in zip(chunks, targets, strict=True):
            values = self.read_values(self.model, chunk)
            loss, stats = value_loss(values, target.old_values, target.returns, chunk.loss_mask,
                                     self.config.value_clip, normalizer)
            loss.backward()
            for key, value in stats.items():
                weight = 1.0 if key in ("critic/value_loss", "critic/tokens") else stats["critic/tokens"]
                sums[key] = sums.get(key, 0.0) + value * weight
        grad_norm = self.clip_gradients(list(self.model.parameters()), self.max_grad_norm)
        self.optimizer.step()
        tokens = sums.pop("critic/tokens").clamp(min=1.0)
        means = {k: v / tokens if k != "critic/value_loss" else v for k, v in sums.items()}
        return {**means, "critic/grad_norm": whole_tensor(grad_norm)}
