"""Supervised warm start (``spec.model.sftWarmup``): a few steps of next-token training on the
task's own prompt → answer pairs, so RL starts from a policy that sometimes succeeds."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from ..data.datasets import Example
from ..models.text import TextCodec


def sft_warmup(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, data: Iterator[Example], steps: int,
               batch_size: int, lr: float, rank: int = 0, world: int = 1) -> list[float]:
    """Train on ``steps`` batches of prompt+answer+eos (loss on the answer only); returns the losses."""
    if steps <= 0:
        return []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    codec = TextCodec(tokenizer)
    for _ in range(steps):
        examples = [next(data) for _ in range(batch_size)][rank::world]
        rows = []
        for ex in examples:
            for prompt, completion in ex.demonstrations or ((ex.prompt, ex.answer),):
                p, a = codec.encode_prompt(prompt), codec.encode_answer(completion)
                rows.append((p, a))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), codec.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
            attn[i, :len(p) + len(a)] = 1
        device = next(model.parameters()).device
        loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
