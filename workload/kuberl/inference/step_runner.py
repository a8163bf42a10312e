"""The torch engine's forward passes and KV cache, apart from its scheduling: one engine step is a
``StepPlan`` — which of the last step's cached rows stay, the token each of them decodes, and the whole
sequences that join — and ``StepRunner.run`` turns it into next-token logits. A plan is plain data,
so every rank of a tensor-parallel replica can run the same one over its own shard of the model and
of the cache (``kuberl.inference.tensor_parallel``), while only the leader schedules and samples.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from ..models import moe_routing
from .kv_batch import KVBatch, LayerKV, concat, selected

# Every backend but cuDNN's: it plans anew for each key length, i.e. every decode step — 1.8 ms of
# host time per layer on an H100 (62.6 → 17.3 ms a step at batch 64 for a 24-layer model without it).
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KEEPALIVE_SECONDS = 60.0  # an idle engine calls ``keepalive`` this often (a replica's workers wait meanwhile)


@dataclass(frozen=True)
class StepPlan:
    """One engine step. The cache's rows afterwards are ``keep``'s rows of the last step (in that order)
    then the ``prefill`` ones; ``keep`` empty drops the old cache (new weights, a pause)."""

    keep: list[int]  # indices of the last step's rows that stay
    decode: list[int]  # the last token of each kept row, fed through the cache
    prefill: list[list[int]]  # each joining row's whole sequence (prompt and output so far)
    record_routes: bool = False  # a mixture-of-experts model's routes are wanted


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [rows, vocab] float: each row's next-token logits, in the cache's row order
    decode_routes: torch.Tensor | None  # [kept rows, layers, k]
    prefill_routes: torch.Tensor | None  # [joined rows, width, layers, k], left-padded to the longest joined row


class StepRunner:
    """Runs ``StepPlan`` s over ``model``, keeping the cache between them."""

    def __init__(self, model: torch.nn.Module, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.moe_layers = len(moe_routing.routers(model))
        self.kv: KVBatch[int] | None = None

    @torch.no_grad()
    @sdpa_kernel(ATTENTION_BACKENDS)
    def run(self, plan: StepPlan) -> StepOutput:
        decoded = self._decode(plan) if plan.keep else None
        prefilled = self._prefill(plan) if plan.prefill else None
        parts = [part for part in (decoded, prefilled) if part is not None]
        if not parts:
            raise ValueError("an engine step with no rows")
        self.kv = parts[0][0] if len(parts) == 1 else concat(parts[0][0], parts[1][0])
        return StepOutput(torch.cat([logits for _, logits, _ in parts]),
                          decoded[2] if decoded else None, prefilled[2] if prefilled else None)

    def _decode(self, plan: StepPlan) -> tuple[KVBatch[int], torch.Tensor, torch.Tensor | None]:
        """Each kept row's last token through the cache: the grown cache, the next logits, the routes."""
        if self.kv is None or max(plan.keep) >= len(self.kv.rows):
            raise ValueError("a step keeps cached rows that are not there")
        kv = self.kv if plan.keep == list(range(len(self.kv.rows))) else selected(self.kv, plan.keep)
        last = torch.tensor([[token] for token in plan.decode], device=kv.mask.device)
        mask = torch.nn.functional.pad(kv.mask, (0, 1), value=1)
        with self._routes(plan) as recorded:
            out = self.model(input_ids=last, attention_mask=mask, position_ids=kv.positions(),
                             past_key_values=DynamicCache(ddp_cache_data=kv.layers), use_cache=True)
        routes = moe_routing.stacked(recorded, self.moe_layers, len(plan.keep)) if recorded else None
        return KVBatch(list(range(len(plan.keep))), _layers(out.past_key_values), mask), \
            out.logits[:, -1, :].float(), routes

    def _prefill(self, plan: StepPlan) -> tuple[KVBatch[int], torch.Tensor, torch.Tensor | None]:
        """Whole sequences, left-padded: their cache, last logits and routes."""
        seqs = plan.prefill
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        device = self.model.device
        mask = mask.to(device)
        with self._routes(plan) as recorded:
            out = self.model(input_ids=ids.to(device), attention_mask=mask,
                             position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        routes = moe_routing.stacked(recorded, self.moe_layers, len(seqs)) if recorded else None
        return KVBatch(list(range(len(seqs))), _layers(out.past_key_values), mask), out.logits[:, -1, :].float(), \
            routes

    def _routes(self, plan: StepPlan) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Record the forward's routes when the model has experts and the plan asks for them."""
        if self.moe_layers and plan.record_routes:
            return moe_routing.recording(self.model)
        return contextlib.nullcontext([])

    def keepalive(self) -> None:
        """The engine has been idle for ``KEEPALIVE_SECONDS``: nothing to do in one process."""

    def close(self) -> None:
        """The engine stops: nothing to release in one process."""

    def load_state(self, state: dict[str, torch.Tensor], strict: bool) -> None:
        """A whole update (``load_state_dict``); the cache goes with the old weights."""
        self.model.load_state_dict(state, strict=strict)
        self.kv = None

    def copy_parameters(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole ``tensors`` into the parameters (and buffers) of those names — the p2p path, and every rank
        of a tensor-parallel replica, which keeps its shard of a split one (the shard ``parallelize_module``
        gave it); the cache goes with the old weights."""
        targets = dict(self.model.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, whole in tensors.items():
                target = targets[name]
                if isinstance(target, DTensor):
                    part = distribute_tensor(whole.to(target.dtype), target.device_mesh, target.placements,
                                             src_data_rank=None)  # every rank has it whole: no communication
                    target.to_local().copy_(part.to_local())
                else:
                    target.copy_(whole)
        self.kv = None


def _layers(cache: DynamicCache) -> list[LayerKV]:
    return [(layer.keys, layer.values) for layer in cache.layers]
