"""One client's training model: the base policy with its own LoRA adapter (sharing the base's tensors with every
other adapter) or a copy of all of it (full-parameter), its optimizer and the gradients it has accumulated
since its last step.

``forward_backward`` adds the gradient of Σ over datums of the loss (:mod:`.losses`) to what earlier
calls left, so several calls before one ``optim_step`` are one larger batch, as in the Tinker API;
``optim_step`` applies AdamW with the hyper-parameters of that call (learning rate, betas, eps,
decoupled weight decay, and a global gradient-norm clip when ``grad_clip_norm`` > 0), then clears the
gradients. ``weights`` is what a sampler of this model serves: the adapter's tensors, or every
parameter.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..api.lora import LoraSpec
from ..inference.engine import max_model_len
from ..models import lora
from .errors import ClientError
from .losses import checked_inputs, loss_named, target_logprobs
from .wire import ForwardBackwardCall

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]


@dataclass(frozen=True)
class AdapterShape:
    """A Tinker ``LoraConfig``: the rank, where the adapter goes, and the seed of its initial A."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None

    @staticmethod
    def same(a: AdapterShape | None, b: AdapterShape | None) -> bool:
        """The same adapter layout (rank and places; the seed only chose its first A), or both full-parameter."""
        if a is None or b is None:
            return a is b
        return dataclasses.replace(a, seed=None) == dataclasses.replace(b, seed=None)

    def spec(self) -> LoraSpec:
        modules = ATTENTION * self.train_attn + MLP * self.train_mlp + UNEMBED * self.train_unembed
        if not modules:
            raise ClientError("lora_config: train_attn, train_mlp and train_unembed are all false")
        return LoraSpec(rank=self.rank, target_modules=modules)


def sharing_base(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` whose parameters and buffers are ``base``'s own tensors: an adapter put on it costs the
    adapter's memory, not another copy of the model. The base is frozen and nothing writes it (an adapter trains
    only its own tensors), so every LoRA model and sampler of a server shares one base."""
    return copy.deepcopy(base, {id(t): t for t in [*base.parameters(), *base.buffers()]})


def adapted(base: torch.nn.Module, adapter: AdapterShape | None) -> torch.nn.Module:
    """``base`` with ``adapter`` on a shared copy (the adapter in float32 whatever the base's dtype: peft's
    default), or (no adapter: full-parameter) a copy of its own with float32 parameters, the weights an
    optimizer steps (a bfloat16 base loses small updates to rounding)."""
    if adapter is None:
        return copy.deepcopy(base).float()
    model = sharing_base(base)
    lora.add_adapter(model, adapter.spec())
    return model


class Trainee:
    def __init__(self, base: torch.nn.Module, adapter: AdapterShape | None, pad_id: int, seed: int = 0):
        """``seed``: the adapter's initial A when its shape names none (B starts at zero either way)."""
        self.model = adapted(base, adapter).train()
        self.adapter = adapter
        if adapter is not None:
            lora.init_adapter(self.model, adapter.seed if adapter.seed is not None else seed)
        else:
            for param in self.model.parameters():
                param.requires_grad_(True)
        self.pad_id = pad_id
        self.device = next(self.model.parameters()).device
        self.vocab = int(self.model.get_input_embeddings().num_embeddings)
        self.max_len = max_model_len(self.model)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.steps = 0

    def _logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[datums, longest, vocab]: each datum right-padded, pads masked out."""
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
        return self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits

    def _check(self, call: ForwardBackwardCall) -> list[dict[str, torch.Tensor]]:
        loss_named(call.loss_fn)
        if not call.data:
            raise ClientError("data: no datums")
        checked = []
        for i, datum in enumerate(call.data):
            if not datum.tokens:
                raise ClientError(f"data[{i}].model_input: no tokens")
            if len(datum.tokens) > self.max_len:
                raise ClientError(f"data[{i}].model_input: {len(datum.tokens)} tokens, the model takes {self.max_len}")
            if min(datum.tokens) < 0 or max(datum.tokens) >= self.vocab:
                raise ClientError(f"data[{i}].model_input: token ids must lie in [0, {self.vocab}), the model's "
                                  "vocabulary")
            inputs = {k: torch.from_numpy(np.array(v)) for k, v in datum.inputs.items()}
            checked.append({k: v.to(self.device) for k, v in
                            checked_inputs(call.loss_fn, inputs, len(datum.tokens), self.vocab, i).items()})
        return checked

    def forward_backward(self, call: ForwardBackwardCall) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Each datum's ``logprobs`` and the metrics (``loss:sum``); gradients added unless forward-only."""
        loss_fn, _ = loss_named(call.loss_fn)
        inputs = self._check(call)
        with torch.set_grad_enabled(not call.forward_only):
            logits = self._logits([d.tokens for d in call.data])
            total = torch.zeros((), device=self.device)
            outputs = []
            for row, (datum, checked) in enumerate(zip(call.data, inputs, strict=True)):
                logp = target_logprobs(logits[row, :len(datum.tokens)], checked["target_tokens"])
                total = total + loss_fn(logp, checked, call.config)
                outputs.append({"logprobs": logp.detach().float().cpu().numpy()})
            if not call.forward_only:
                total.backward()
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.trained, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": float(norm)}

    def optimizer_state(self) -> dict[str, object]:
        return self.optimizer.state_dict()

    def restore(self, weights: dict[str, torch.Tensor], optimizer: dict[str, object] | None, steps: int) -> None:
        """Back to a saved state: its trained weights and, when given, its optimizer's moments and step count."""
        missing = set(self._weight_names()) ^ set(weights)
        if missing:
            raise ClientError(f"the state's weights do not fit this model (differing: {sorted(missing)[:3]} …): "
                              "load it into a model with the same LoRA shape, or create one from it")
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=False)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            self.steps = steps
        self.optimizer.zero_grad(set_to_none=True)

    def _weight_names(self) -> list[str]:
        names = list(self.model.state_dict())
        return [n for n in names if lora.is_adapter_weight(n)] if self.adapter is not None else names

    def weights(self) -> dict[str, torch.Tensor]:
        """What a sampler of this model needs beyond the base: the adapter's tensors, or every one (copies)."""
        state = self.model.state_dict()
        return {name: state[name].detach().clone() for name in self._weight_names()}
