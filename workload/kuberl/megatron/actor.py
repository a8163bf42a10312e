"""The Megatron-core backend's actor: the FSDP actor's decoupled-PPO step
(:class:`kuberl.trainer.actor.Actor`: one loss, one update rule) on a Megatron GPTModel with tensor
parallelism. What differs is how the model is read and how the gradient norm is taken:

- log-probs and entropy from vocabulary-parallel logits (:mod:`.logprobs`), the forward under
  :func:`.cpu.on_device` (the CPU shim on CPU, nothing on an accelerator);
- Qwen3's q/k norms, whole on every rank but fed only its heads: their gradients summed over the
  tensor-parallel ranks first (as Megatron's ``finalize_model_grads``);
- data parallelism: the ranks of a data-parallel group hold the same pieces and split the batch's
  rows (:meth:`MegatronActor.data_parallel`); their gradients are averaged (an all-reduce over the
  group ÷ its size) before anything else reads them, so every replica takes the same step — the
  actor's loss normaliser (global tokens ÷ data-parallel ranks) makes that average the global mean;
- the global gradient norm for clipping, ‖g‖² = all-reduce_TP(Σ_split ‖g_r‖²) + Σ_whole ‖g‖²: a split
  parameter's pieces are summed over the tensor-parallel ranks, a whole one (the norms, the same on
  every rank) is counted once; then g ← g · min(1, max_norm / (‖g‖ + 1e-6)), as torch clips.

The ranks of a tensor-parallel group hold the same rows; the actor's world-wide sums (the gap and
entropy sums) then count each token once per tensor-parallel rank in numerator and denominator
alike, so every mean is the global one. The optimizer is torch's AdamW on each rank's pieces
(Megatron's distributed optimizer, which shards its state over the data-parallel ranks, is not used).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from ..collectives import all_gather, broadcast_from_rank0
from ..data.datasets import Example
from ..trainer.actor import Actor
from ..trainer.algorithms import AlgorithmConfig
from ..trainer.batch import Batch
from ..trainer.sft import sft_warmup
from ..weights.layouts import ParamMeta, tp_box
from ..weights.plan import Holding
from .cpu import on_device
from .logprobs import token_logprobs_and_entropy
from .model import (
    all_reduce_in_place,
    build_gpt_model,
    export_hf_state,
    load_hf_state,
    local_hf_state,
    sum_partial_gradients,
)


def scorer_on(device: torch.device) -> Callable[[Any, Batch, float], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`.logprobs.token_logprobs_and_entropy`, run where megatron-core can run on ``device``."""
    def score(model: Any, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device(device):
            return token_logprobs_and_entropy(model, batch, temperature)
    return score


def average_over_data_parallel_ranks(params: list[torch.nn.Parameter]) -> None:
    """g ← all-reduce_DP(g) / |DP| for every gradient, one flat buffer per call (no-op without data parallelism)."""
    from megatron.core import parallel_state

    size = parallel_state.get_data_parallel_world_size()
    if size > 1:
        all_reduce_in_place([p.grad for p in params if p.grad is not None], parallel_state.get_data_parallel_group(),
                            divisor=size)


def reduce_and_clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Average the gradients over the data-parallel ranks, complete the partial ones
    (:func:`.model.sum_partial_gradients`), then clip in place to the global norm over every
    tensor-parallel rank; returns that norm."""
    from megatron.core import parallel_state

    average_over_data_parallel_ranks(params)
    sum_partial_gradients(params)
    grads = [p for p in params if p.grad is not None]
    split = [p.grad.float().pow(2).sum() for p in grads if getattr(p, "tensor_model_parallel", False)]
    whole = [p.grad.float().pow(2).sum() for p in grads if not getattr(p, "tensor_model_parallel", False)]
    split_sq = torch.stack(split).sum() if split else torch.zeros(())
    dist.all_reduce(split_sq, group=parallel_state.get_tensor_model_parallel_group())
    norm = (split_sq + (torch.stack(whole).sum() if whole else torch.zeros(()))).sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in grads:
        p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm


@dataclass
class MegatronActor(Actor):
    hf_model: Any = None  # the HF twin: its config names the exported weights; the SFT warm-up trains it

    @property
    def hf_config(self) -> Any:
        return self.hf_model.config

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): the ranks of one tensor-parallel
        group train on the same rows."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @property
    def checkpoint_namespace(self) -> str:
        """Tensor-parallel rank r saves its pieces under ``tp<r>`` (a resume needs the same tensor-parallel
        size); its data-parallel replicas save the same tensors under the same names, which DCP writes once."""
        from megatron.core import parallel_state

        return f"tp{parallel_state.get_tensor_model_parallel_rank()}"

    def supervised_warm_up(self, tokenizer: PreTrainedTokenizerBase, data: Iterator[Example], steps: int,
                           batch_size: int, lr: float) -> list[float]:
        """``spec.model.sftWarmup`` on the HF twin in rank 0 (every batch whole), then every rank loads
        the result: a few small steps, on the model the inference engines serve."""
        rank = dist.get_rank()
        losses = sft_warmup(self.hf_model, tokenizer, data, steps, batch_size, lr) if rank == 0 else []
        for tensor in self.hf_model.state_dict().values():
            dist.broadcast(tensor.data, src=0)
        with on_device(self.device):
            load_hf_state(self.model, self.hf_model.state_dict(), self.hf_config)
        return broadcast_from_rank0(losses)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, config: AlgorithmConfig, lr: float, temperature: float,
                mini_batches: int = 1, device: torch.device | None = None, seed: int = 0) -> MegatronActor:
        """A GPTModel holding ``hf_model``'s weights (this rank's tensor-parallel piece), AdamW as the
        FSDP actor's, and a frozen copy as π_ref when ``config.kl_coef > 0``. Needs an initialised
        ``megatron.core.parallel_state``."""
        device = device or torch.device("cpu")
        with on_device(device):
            model = build_gpt_model(hf_model.config, seed)
            load_hf_state(model, hf_model.state_dict(), hf_model.config)
        model = model.to(device)
        reference = copy.deepcopy(model).requires_grad_(False).eval() if config.kl_coef > 0 else None
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)
        return cls(model, optimizer, config, temperature, mini_batches, reference=reference, device=device,
                   scorer=scorer_on(device), clip_gradients=reduce_and_clip_gradients, hf_model=hf_model)

    def freeze_reference(self) -> None:
        """π_ref := the current policy (each rank copies its own pieces)."""
        if self.reference is not None:
            with torch.no_grad():
                for ref, param in zip(self.reference.parameters(), self.model.parameters(), strict=True):
                    ref.copy_(param)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its HF name with its whole shape (the HF twin's: a tied output layer once)."""
        return dict(self.hf_model.named_parameters())

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter under its HF name (:func:`.model.local_hf_state`)."""
        names = self.named_parameters()
        return {n: t for n, t in local_hf_state(self.model, self.hf_config).items() if n in names}

    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        """Rank g holds :func:`~kuberl.weights.layouts.tp_box` of its tensor-parallel index (all-gathered:
        Megatron's rank order decides it); data-parallel replicas hold the same boxes, so the planner
        spreads the sending over them."""
        from megatron.core import parallel_state

        size = parallel_state.get_tensor_model_parallel_world_size()
        indices = all_gather(parallel_state.get_tensor_model_parallel_rank())
        return [Holding(rank, m.name, tp_box(m, size, index)) for rank, index in enumerate(indices) for m in metas]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights under HF names on rank 0 (CPU), an empty dict elsewhere; every rank must call it."""
        state = export_hf_state(self.model, self.hf_config)
        return {n: t.detach().cpu() for n, t in state.items()} if dist.get_rank() == 0 else {}
