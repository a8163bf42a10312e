"""The FSDP2 backend: the policy sharded with ``fully_shard`` on gloo / NCCL / HCCL, mixed precision,
DCP checkpoints, and the step of :mod:`kuberl.policy.actor`.

``full_state_dict()`` gathers the unsharded weights on rank 0 (CPU) for the weight exchange. With
``spec.trainer.lora`` (:mod:`kuberl.models.lora`) only the adapter is trained and checkpointed, and
only it goes to the replicas (:class:`AdapterWeights`); ``full_state_dict()`` is then the policy
with the adapter merged (exports, the critic's start).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..api.lora import LoraSpec
from ..collectives import world_size
from ..data.datasets import Example
from ..models import lora
from ..models.meta import is_meta, materialize
from ..models.text import TextCodec
from ..policy.actor import (
    Actor,
    ChunkReader,
    packed_token_logprobs_and_entropy,
    plain_loop,
    token_logprobs_and_entropy,
)
from ..policy.algorithms import AlgorithmConfig
from ..policy.batch import Batch
from ..policy.critic import VALUE_HEAD, Critic, CriticConfig, packed_values, padded_values, value_model
from ..policy.sft import sft_warmup
from ..weights.layouts import ParamMeta, fsdp2_holdings
from ..weights.p2p import WeightSource
from ..weights.plan import Holding
from ..weights.transport import local_tensor, whole_tensor


def shard(model: torch.nn.Module, frozen: bool = False, compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """FSDP2: each transformer block is a unit, then the root (embeddings, head).

    FSDP2 keeps the root unsharded after forward, for the backward that follows; a ``frozen`` model
    (no backward, e.g. the KL reference) reshards its root after forward too. A ``compute_dtype``
    other than float32 is FSDP2 mixed precision: parameters are all-gathered and used in that dtype,
    gradients reduced in float32, master weights and optimizer state stay float32 — for the parameters
    that train. Those that do not (a LoRA adapter's base, the whole KL reference) are stored in
    ``compute_dtype`` (:func:`store_frozen_in`).
    """
    store_frozen_in(model, compute_dtype)
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer, mp_policy=mixed)
    fully_shard(model, reshard_after_forward=True if frozen else None, mp_policy=mixed)
    return model


def store_frozen_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter of ``model`` that does not train is stored in ``dtype``, in place
    (on ``meta`` too). Mixed precision only ever uses it in that dtype (the all-gather casts it), so
    this rounds nothing the forward did not round already — a LoRA step is bit for bit the same
    (tests/test_lora.py) — and in bfloat16 holds it in half the memory. FSDP2 needs one dtype only
    among a unit's trainable parameters."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def build_critic(policy: torch.nn.Module, config: CriticConfig, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32, weights: Path | None = None,
                 activation_checkpointing: bool = False, packing: bool = False) -> Critic:
    """``ppo``'s critic for either backend: the value model of the (unsharded) ``policy``
    (:func:`~kuberl.policy.critic.value_model`), sharded with FSDP2 over every rank and placed as the
    policy (a ``meta`` policy's is filled from ``weights``, its head zero), with its own AdamW."""
    values = value_model(policy)
    on_meta = is_meta(values)
    if activation_checkpointing:
        values.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    values = shard(values if on_meta else values.to(device), compute_dtype=compute_dtype)
    if on_meta:
        if weights is None:
            raise ValueError("a critic on the meta device needs the directory of the policy's weights")
        materialize(values, weights, device, zeros=(VALUE_HEAD,))
    optimizer = torch.optim.AdamW(values.train().parameters(), lr=config.learning_rate, weight_decay=0.0,
                                  foreach=True)  # over the parameters as filled
    return Critic(values, optimizer, config, packed_values if packing else padded_values)


@dataclass
class FSDPActor(Actor):
    """:class:`~kuberl.policy.actor.Actor` over an HF model sharded with FSDP2 (every rank a
    data-parallel rank; the HF forward reads it, torch clips over its DTensors)."""

    @classmethod
    def create(cls, model: torch.nn.Module, config: AlgorithmConfig, lr: float, temperature: float,
               mini_batches: int = 1, device: torch.device | None = None,
               compute_dtype: torch.dtype = torch.float32, weights: Path | None = None,
               activation_checkpointing: bool = False, packing: bool = False,
               critic: CriticConfig | None = None, adapter: LoraSpec | None = None, seed: int = 0) -> FSDPActor:
        """Place ``model`` (float32 master weights) on ``device``, shard it, build the optimizer. A
        ``model`` on the ``meta`` device is filled after sharding from the safetensors in ``weights``,
        each rank reading its own shards (:mod:`kuberl.models.meta`). ``activation_checkpointing``:
        each block's activations are recomputed in the backward pass instead of kept. ``packing``: each
        micro-batch's rows are packed (:mod:`kuberl.policy.packing`).
        ``critic`` (ppo): a value model from the same weights (:func:`~kuberl.policy.critic.value_model`),
        sharded, placed and checkpointed alike, with its own AdamW (the whole value model, with or without
        an adapter on the policy). ``adapter``: a LoRA adapter on the policy (:func:`~kuberl.models.lora.add_adapter`;
        on ``meta`` drawn from ``seed``), the only parameters the optimizer sees."""
        device = device or torch.device("cpu")
        on_meta = is_meta(model)
        if on_meta and weights is None:
            raise ValueError("a model on the meta device needs the directory of its weights")
        if not on_meta:
            model = model.to(device=device, dtype=torch.float32)
        if activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        value_critic = None
        if critic is not None:  # from the unsharded policy, before any adapter
            value_critic = build_critic(model, critic, device, compute_dtype, weights, activation_checkpointing,
                                        packing)
        if adapter is not None:
            lora.add_adapter(model, adapter)
        reference = None
        if config.kl_coef > 0:
            reference = shard(copy.deepcopy(model).requires_grad_(False), True, compute_dtype).eval()
        model = shard(model, compute_dtype=compute_dtype)
        if on_meta and weights is not None:
            for sharded in (model, *([reference] if reference is not None else [])):
                materialize(sharded, weights, device, renamed=lora.file_name)
                lora.init_adapter(sharded, seed)
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0, foreach=True)
        scorer = packed_token_logprobs_and_entropy if packing else token_logprobs_and_entropy
        return cls(model, optimizer, config, temperature, mini_batches, reference=reference, device=device,
                   scorer=scorer, packing=packing, critic=value_critic, adapter=adapter)

    def forward_backward(self, model: torch.nn.Module, chunks: list[Batch], on_scores: ChunkReader,
                         forward_only: bool) -> list[Any]:
        """Chunk after chunk (:func:`~kuberl.policy.actor.plain_loop`): FSDP2 gathers each block's
        shards in the forward and reduces its gradients in the backward. A forward-only pass reshards the
        root after it: FSDP2 keeps a root unsharded for the backward that is not coming, and until it
        reshards ``model.parameters()`` are its unsharded tensors, not the optimizer's."""
        kept = plain_loop(self.scorer, self.temperature, model, chunks, on_scores, forward_only)
        if forward_only and isinstance(model, FSDPModule):
            model.reshard()
        return kept

    def compute_scope(self) -> contextlib.AbstractContextManager[Any]:
        """None: torch's own device handling."""
        return contextlib.nullcontext()

    def as_reported(self, stats: dict[str, float]) -> dict[str, float]:
        """This rank's own: every rank computes the loss."""
        return stats

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's index, how many) among the ranks that split a batch's rows: every rank (FSDP2)."""
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def _sharded_state(self) -> dict[str, Any]:
        """Model, optimizer and, with a KL term, the frozen reference (FSDP2 shards carry their placement);
        with an adapter, the adapter's part of each model (the base comes from ``spec.model``)."""
        options = StateDictOptions(ignore_frozen_params=self.adapter is not None)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        if self.reference is not None:
            state["reference"] = get_model_state_dict(self.reference)
        if self.adapter is not None:  # a tied output layer still shows up as trainable: by name, then
            state |= {key: lora.adapter_only(state[key]) for key in ("model", "reference") if key in state}
        return state

    def save_shards(self, directory: Path) -> None:
        """Every rank writes its shards into ``directory`` (torch.distributed.checkpoint)."""
        dcp.save(self._sharded_state(), checkpoint_id=str(directory))

    def load_shards(self, directory: Path) -> None:
        """Every rank reads its shards from what :meth:`save_shards` wrote, over any number of ranks."""
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(directory))
        options = StateDictOptions(strict=self.adapter is None)  # an adapter's checkpoint holds only it
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        if self.reference is not None:
            set_model_state_dict(self.reference, state["reference"], options=options)

    @property
    def checkpoint_layout(self) -> dict[str, str | int]:
        """What a resume must share with the run that saved: the backend (DCP re-shards FSDP2's
        shards over any number of ranks) and the adapter, if any (its checkpoint holds only it)."""
        if self.adapter is None:
            return {"backend": "fsdp"}
        return {"backend": "fsdp", "adapter": adapter_layout(self.adapter)}

    def supervised_warm_up(self, codec: TextCodec, data: Iterator[Example], steps: int,
                           batch_size: int, lr: float) -> list[float]:
        """``spec.model.sftWarmup`` on the sharded model, each rank on its share of every batch."""
        rank, world = self.data_parallel()
        return sft_warmup(self.model, codec, data, steps, batch_size, lr, rank, world)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded HF-named weights on rank 0 (an empty dict on other ranks; an adapter merged into
        them); every rank must call it."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.adapter is None else lora.merged(state, self.adapter.scaling)

    def weight_source(self) -> WeightSource:
        """The whole policy, or with an adapter only the adapter (the replicas hold the base)."""
        return self if self.adapter is None else AdapterWeights(self)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (FSDP2 DTensors: full shape, this rank's shard inside)."""
        return dict(self.model.named_parameters())

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's FSDP2 shard of every parameter (rows ``torch.chunk`` gives it on dim 0)."""
        return {name: local_tensor(p) for name, p in self.model.named_parameters()}

    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        """FSDP2's dim-0 shards over every rank (:func:`~kuberl.weights.layouts.fsdp2_holdings`)."""
        return fsdp2_holdings(metas, list(range(world_size())))


def adapter_layout(adapter: LoraSpec) -> str:
    """An adapter's shape as a checkpoint records it: a resume needs the same."""
    return f"lora rank {adapter.rank}, targets {','.join(adapter.target_modules)}"


@dataclass
class AdapterWeights:
    """The weight exchange's view of an actor with a LoRA adapter: the adapter's tensors only, under
    the names the torch engine's adapted model gives them (:mod:`kuberl.models.lora`)."""

    actor: FSDPActor

    def _adapter(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.actor.model.named_parameters() if lora.is_adapter_weight(name)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole adapter on rank 0 (an empty dict elsewhere); every rank must call it (each
        tensor is all-gathered: the adapter is small)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        full = {name: whole_tensor(p) for name, p in self._adapter().items()}
        return {name: t.detach().cpu() for name, t in full.items()} if rank == 0 else {}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self._adapter()

    def local_parameters(self) -> dict[str, torch.Tensor]:
        return {name: local_tensor(p) for name, p in self._adapter().items()}

    def holdings(self, metas: list[ParamMeta]) -> list[Holding]:
        return self.actor.holdings(metas)
