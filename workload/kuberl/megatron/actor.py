"""The Megatron-core backend's actor: the FSDP actor's decoupled-PPO step
(:class:`kuberl.policy.actor.Actor`: one loss, one update rule) on a Megatron GPTModel with tensor,
pipeline, expert and data parallelism. What differs is how the model is read and how the gradient norm is taken:

- log-probs and entropy from vocabulary-parallel logits (:mod:`.logprobs`), the forward under
  :func:`.cpu.on_device` (the CPU shim on CPU, nothing on an accelerator);
- Qwen3's q/k norms, whole on every rank but fed only its heads: their gradients summed over the
  tensor-parallel ranks first (as Megatron's ``finalize_model_grads``);
- data parallelism: the ranks of a data-parallel group hold the same pieces and split the batch's
  rows (:meth:`MegatronActor.data_parallel`); their gradients are averaged (an all-reduce over the
  group ÷ its size) before anything else reads them, so every replica takes the same step — the
  actor's loss normaliser (global tokens ÷ data-parallel ranks) makes that average the global mean;
- expert parallelism (a mixture of experts): each rank holds some of every layer's experts
  (:mod:`.expert_parallel`); their gradients are averaged over the ranks that hold the same experts;
  with tensor parallelism a mixture of experts runs sequence-parallel (:mod:`.layer_spec`), its
  norm and router gradients summed over the tensor-parallel ranks; batches are padded (or packed:
  ``spec.trainer.packing``) to a shape the layout can take (:mod:`.inputs`);
- context parallelism: the ranks of a context-parallel group hold the same rows and each takes its
  positions of them (:mod:`.context_parallel`); every rank of the group computes the same loss from
  the gathered log-probs, each parameter's gradient is the sum of what the ranks' positions gave it;
- the compute dtype: float32 parameters, gradients and optimizer state, the forward and backward on
  copies cast to ``model.dtype`` (:func:`.logprobs.vocab_parallel_logits`), as FSDP2's mixed precision;
- pipeline parallelism: each stage holds consecutive layers (:mod:`.pipeline`); micro-batches go
  through megatron-core's 1F1B schedule (:mod:`.schedule`) with the actor's own loss on the last
  stage, π_prox and π_ref read by forward-only passes, the last stage's stats reported by every
  stage; a tied embedding's two copies (first and last stage) have their gradients summed;
- the global gradient norm for clipping (:func:`.norms.global_squared_norm`): every piece counted once;
  then g ← g · min(1, max_norm / (‖g‖ + 1e-6)), as torch clips.

The ranks of a tensor-parallel group hold the same rows; the actor's world-wide sums (the gap and
entropy sums) then count each token once per tensor-parallel rank in numerator and denominator
alike, so every mean is the global one. The optimizer is torch's AdamW on each rank's pieces, its
state optionally sharded over the data-parallel ranks (ZeRO-1: :mod:`.optimizer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import all_gather, broadcast_from_rank0
from ..data.datasets import Example
from ..devices import placed
from ..models.meta import FileState, is_meta, materialize
from ..models.text import TextCodec
from ..policy.actor import TOKEN_SUMS, Actor, ChunkReader, plain_loop
from ..policy.algorithms import AlgorithmConfig
from ..policy.batch import TOKEN_BUDGET, Batch
from ..policy.critic import Critic
from ..policy.sft import sft_warmup
from ..weights.layouts import ParamMeta, ep_box, hf_stage, is_stacked_expert, tp_box
from ..weights.p2p import WeightSource
from ..weights.plan import Holding
from . import checkpoint, optimizer
from .cpu import on_device
from .logprobs import token_logprobs_and_entropy
from .model import (
    all_reduce_in_place,
    build_gpt_model,
    export_hf_state,
    load_hf_state,
    local_hf_state,
    sum_partial_gradients,
    sum_shared_embedding_gradients,
)
from .norms import global_squared_norm, squared_sums, update_norms
from .schedule import through_pipeline


def scorer_on(device: torch.device, compute_dtype: torch.dtype = torch.float32, packed: bool = False
              ) -> Callable[[Any, Batch, float], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`.logprobs.token_logprobs_and_entropy` in ``compute_dtype``, padded or ``packed``
    (:mod:`.inputs`), run where megatron-core can run on ``device``."""
    def score(model: Any, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device(device):
            return token_logprobs_and_entropy(model, batch, temperature, compute_dtype, packed)
    return score


def average_over_data_parallel_ranks(params: list[torch.nn.Parameter]) -> None:
    """g ← all-reduce(g) / |DP| for every gradient, one flat buffer per group (no-op on one rank): a
    dense parameter's over its data-parallel group together with its context-parallel group (a sum
    over the positions, an average over the rows); an expert's over its expert-data-parallel group
    (every rank holding the same experts: with sequence parallelism the tensor-parallel ranks too,
    each having routed its own tokens) — its gradient already sums what every rank of its
    expert-parallel group routed to it, so it is divided by the whole |DP| too (as Megatron's DDP)."""
    from megatron.core import parallel_state

    size = parallel_state.get_data_parallel_world_size()
    grads = [p for p in params if p.grad is not None]
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        all_reduce_in_place([p.grad for p in grads if not getattr(p, "expert_parallel", False)],
                            parallel_state.get_data_parallel_group(with_context_parallel=True), divisor=size)
    if parallel_state.get_expert_data_parallel_world_size() > 1 or size > 1:
        all_reduce_in_place([p.grad for p in grads if getattr(p, "expert_parallel", False)],
                            parallel_state.get_expert_data_parallel_group(), divisor=size)


def reduce_and_clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Average the gradients over the data-parallel ranks, complete the partial ones
    (:func:`.model.sum_partial_gradients`), then clip in place to the global norm over every rank's
    pieces (:func:`.norms.global_squared_norm`); returns that norm."""
    average_over_data_parallel_ranks(params)
    sum_partial_gradients(params)
    grads = [p for p in params if p.grad is not None]
    device = grads[0].device if grads else params[0].device
    norm = global_squared_norm(*squared_sums(((p, p.grad) for p in grads), device)).sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in grads:
        p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm


@dataclass
class MegatronActor(Actor):
    hf_model: Any = None  # the HF twin: its config names the exported weights; the SFT warm-up trains it
    hf_files: Path | None = None  # where a twin on ``meta`` has its weights
    compute_dtype: torch.dtype = torch.float32

    @property
    def hf_config(self) -> Any:
        return self.hf_model.config

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): the ranks of one tensor-parallel
        group train on the same rows."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def save_shards(self, directory: Path) -> None:
        """Every rank writes its pieces under whole-model keys (:mod:`.checkpoint`): any layout can
        resume (a sharded optimizer's state gathered first: :func:`.optimizer.whole_adamw`)."""
        with on_device(self.device):
            whole = optimizer.whole_adamw(self.optimizer, list(self.model.parameters()))
            checkpoint.save(self.model, whole, self.reference, directory)

    def load_shards(self, directory: Path) -> None:
        """Every rank reads the slices its own pieces cover, whatever layout wrote them."""
        with on_device(self.device):
            whole = optimizer.whole_adamw(self.optimizer, list(self.model.parameters()), gather=False)
            checkpoint.load(self.model, whole, self.reference, directory)
            optimizer.keep_own_part(self.optimizer, whole)

    @property
    def checkpoint_layout(self) -> dict[str, str | int]:
        """The backend: Megatron's checkpoints load into any of its layouts (:mod:`.checkpoint`)."""
        return {"backend": "megatron"}

    def supervised_warm_up(self, codec: TextCodec, data: Iterator[Example], steps: int,
                           batch_size: int, lr: float) -> list[float]:
        """``spec.model.sftWarmup`` on the HF twin in rank 0 (every batch whole), then every rank loads
        the result: a few small steps, on the model the inference engines serve. A twin built on
        ``meta`` is read from the policy's files for it (on every rank: rank 0's result is broadcast
        into it) and put back on ``meta`` after."""
        if steps <= 0:
            return []
        on_meta = is_meta(self.hf_model)
        if on_meta:
            if self.hf_files is None:
                raise ValueError("an HF twin on the meta device needs the directory of the policy's weights")
            materialize(self.hf_model, self.hf_files, torch.device("cpu"))
        rank = dist.get_rank()
        losses = sft_warmup(self.hf_model, codec, data, steps, batch_size, lr) if rank == 0 else []
        for tensor in self.hf_model.state_dict().values():
            dist.broadcast(tensor.data, src=0)
        with on_device(self.device):
            load_hf_state(self.model, self.hf_model.state_dict(), self.hf_config)
        if on_meta:
            self.hf_model.to("meta")
        return broadcast_from_rank0(losses)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, config: AlgorithmConfig, lr: float, temperature: float,
                mini_batches: int = 1, device: torch.device | None = None, seed: int = 0,
                compute_dtype: torch.dtype = torch.float32, critic: Critic | None = None,
                distributed_optimizer: bool = False, packing: bool = False,
                weights: Path | None = None) -> MegatronActor:
        """A GPTModel holding ``hf_model``'s weights (this rank's tensor-parallel piece and experts),
        AdamW as the FSDP actor's, and a frozen copy as π_ref when ``config.kl_coef > 0`` (held in
        ``compute_dtype``, as FSDP2 holds its own). The
        parameters, their gradients and the optimizer state are float32; forward and backward run in
        ``compute_dtype`` (:func:`.logprobs.vocab_parallel_logits`). Needs an initialised
        ``megatron.core.parallel_state``. ``critic`` (ppo): its value model, built apart
        (:class:`~kuberl.policy.critic.Critic`: an FSDP2 HF model over every rank).
        ``distributed_optimizer``: AdamW's state sharded over the data-parallel ranks (:mod:`.optimizer`).
        ``packing``: each micro-batch's rows packed (:mod:`.inputs`). The micro-batches' token budget
        counts a rank's tokens: under context parallelism c it holds c × the rows' tokens.
        An ``hf_model`` on the ``meta`` device (names, shapes, config) is read from the safetensors in
        ``weights`` a layer at a time, each rank keeping its pieces (:class:`kuberl.models.meta.FileState`),
        and stays the (weightless) twin."""
        device = device or torch.device("cpu")
        on_meta = is_meta(hf_model)
        if on_meta and weights is None:
            raise ValueError("a model on the meta device needs the directory of its weights")
        with on_device(device):
            model = build_gpt_model(hf_model.config, seed, compute_dtype)
            source = (FileState(weights, hf_model) if on_meta and weights is not None
                      else contextlib.nullcontext(hf_model.state_dict()))
            with source as state:
                load_hf_state(model, state, hf_model.config)
            reference = None
            if config.kl_coef > 0:  # built anew: a GPTModel holds process groups, which do not deep-copy
                reference = build_gpt_model(hf_model.config, seed, compute_dtype)
                reference.load_state_dict(model.state_dict())
                # stored in the compute dtype: its forward casts every parameter to it first, so the same numbers
                reference = placed(reference, device, compute_dtype).requires_grad_(False).eval()
        model = model.to(device)
        model.train()
        adamw = optimizer.make_optimizer(model.parameters(), lr, distributed_optimizer)
        from megatron.core import parallel_state

        budget = TOKEN_BUDGET * parallel_state.get_context_parallel_world_size()  # each rank computes W ÷ c of a row
        return cls(model, adamw, config, temperature, mini_batches, token_budget=budget, reference=reference,
                   device=device, scorer=scorer_on(device, compute_dtype, packing),
                   clip_gradients=reduce_and_clip_gradients, update_norms=update_norms, packing=packing, critic=critic,
                   hf_model=hf_model,
                   hf_files=weights if on_meta else None, compute_dtype=compute_dtype)

    @property
    def stages(self) -> int:
        """The pipeline-parallel size."""
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_world_size()

    def forward_backward(self, model: torch.nn.Module, chunks: list[Batch], on_scores: ChunkReader,
                         forward_only: bool) -> list[Any]:
        """Chunk after chunk on one stage (:func:`~kuberl.policy.actor.plain_loop`); with pipeline
        parallelism through Megatron's 1F1B schedule (:func:`.schedule.through_pipeline`: what
        ``on_scores`` keeps on the last stage, an empty list elsewhere). After a backward, a tied
        embedding's two copies' gradients summed."""
        if self.stages == 1:
            kept = plain_loop(self.scorer, self.temperature, model, chunks, on_scores, forward_only)
        else:
            kept = through_pipeline(model, chunks, on_scores, self.temperature, self.compute_dtype,
                                    forward_only=forward_only, packed=self.packing)
        if not forward_only:
            sum_shared_embedding_gradients(model)
        return kept

    def compute_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where megatron-core can run on this device (:func:`.cpu.on_device`): the backward of its token
        exchange between expert-parallel ranks allocates on the device too, not only the forward."""
        return on_device(self.device)

    def as_reported(self, stats: dict[str, float]) -> dict[str, float]:
        """With pipeline parallelism every stage reports the last stage's stats (the loss is there),
        but the token sums only the last stage counts."""
        if self.stages == 1:
            return stats
        from megatron.core import parallel_state

        last = [stats]
        dist.broadcast_object_list(last, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return stats | {k: v for k, v in last[0].items() if k not in TOKEN_SUMS}

    def weight_source(self) -> WeightSource:
        """The whole policy: this actor (Megatron trains no adapter)."""
        return self

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its HF name with its whole shape (the HF twin's: a tied output layer once)."""
        return dict(self.hf_model.named_parameters())

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter under its HF name (:func:`.model.local_hf_state`)."""
        names = self.named_parameters()
        return {n: t for n, t in local_hf_state(self.model, self.hf_config).items() if n in names}

    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        """Rank g holds, of its pipeline stage's parameters (:func:`~kuberl.weights.layouts.hf_stage`: the
        planner's rule),
        :func:`~kuberl.weights.layouts.tp_box` of its tensor-parallel index and
        :func:`~kuberl.weights.layouts.ep_box` of its expert-parallel index (all-gathered: Megatron's
        rank order decides them); data-parallel replicas hold the same boxes, so the planner spreads
        the sending over them."""
        from megatron.core import parallel_state

        tp, ep = (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_expert_model_parallel_world_size())
        layers = self.hf_config.num_hidden_layers
        indices = all_gather((parallel_state.get_tensor_model_parallel_rank(),
                              parallel_state.get_expert_model_parallel_rank(),
                              parallel_state.get_pipeline_model_parallel_rank()))
        return [Holding(rank, m.name, ep_box(m, ep, e) if is_stacked_expert(m.name) else tp_box(m, tp, t))
                for rank, (t, e, s) in enumerate(indices) for m in metas
                if hf_stage(m.name, layers, self.stages) == s]  # fmt: skip

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights under HF names on rank 0 (CPU), an empty dict elsewhere; every rank must call it.
        A snapshot: no tensor shares memory with a parameter the next step changes."""
        state = export_hf_state(self.model, self.hf_config)
        return {n: t.detach().to("cpu", copy=True) for n, t in state.items()} if dist.get_rank() == 0 else {}
