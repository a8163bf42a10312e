"""The policy under training: FSDP2 (``fully_shard``) on gloo / NCCL / HCCL, one decoupled-PPO step.

A step, for a batch of trajectories already split across data-parallel ranks:

1. proximal log-probs: log π_prox(token) with the current weights, no grad;
2. for each micro-batch: log π_θ with grad, the decoupled PPO loss normalised by the *global*
   token count ÷ world size (FSDP averages gradients over ranks, so the sum is the global mean);
3. gradient clipping, AdamW step.

``full_state_dict()`` gathers the unsharded weights on rank 0 (CPU) for the weight exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from .algorithms import AlgorithmConfig
from .batch import Batch, micro_batches
from .loss import ppo_loss


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each transformer block is a unit, then the root (embeddings, head)."""
    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """log π(target) at every position, under the temperature-scaled policy (as the engine samples)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class Actor:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: AlgorithmConfig
    temperature: float
    token_budget: int = 16384
    max_grad_norm: float = 1.0

    @classmethod
    def create(cls, model: torch.nn.Module, config: AlgorithmConfig, lr: float, temperature: float) -> Actor:
        model = shard(model)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        return cls(model, optimizer, config, temperature)

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return float(t.item())

    def train_step(self, batch: Batch, global_rows: int) -> dict[str, float]:
        start = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        chunks = micro_batches(batch, self.token_budget)
        with torch.no_grad():
            prox = [token_logprobs(self.model, c, self.temperature) for c in chunks]
        if self.config.loss_agg == "seq_sum_const":
            normalizer = global_rows * self.config.max_new_tokens / world
        else:
            normalizer = max(self._global_sum(float(batch.loss_mask.sum())), 1.0) / world
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        for chunk, prox_logp in zip(chunks, prox, strict=True):
            logp = token_logprobs(self.model, chunk, self.temperature)
            out = ppo_loss(logp, prox_logp, chunk.behav_logp, chunk.advantages, chunk.loss_mask, self.config,
                           normalizer=normalizer)
            out.loss.backward()
            for k, v in out.stats.items():
                stats[k] = stats.get(k, 0.0) + v * chunk.size / batch.size
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        stats["ppo_actor/grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                             else grad_norm)
        stats["timeperf/train_step"] = time.perf_counter() - start
        return stats

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on rank 0 (an empty dict on other ranks); every rank must call it."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
