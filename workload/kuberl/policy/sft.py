"""Supervised warm start (``spec.model.sftWarmup``): a few steps of next-token training on the
task's own prompt → answer pairs, so RL starts from a policy that sometimes succeeds.

A step's loss is the mean cross-entropy over its answer tokens (what HF's ``labels=`` loss gives for
the whole batch at once), computed in slices of rows of like length (``batch.slice_count``), each
padded only to its own longest row: the same gradient, without computing the padding.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..collectives import all_reduce
from ..data.datasets import Example
from ..models.text import TextCodec
from .batch import slice_bounds, slice_count

Row = tuple[list[int], list[int]]  # prompt tokens, answer tokens (+ eos)


def demonstration_rows(codec: TextCodec, examples: list[Example]) -> list[Row]:
    """Every (prompt, completion) of ``examples`` (their demonstrations, else prompt → answer), encoded."""
    return [(codec.encode_prompt(prompt), codec.encode_answer(completion))
            for ex in examples for prompt, completion in ex.demonstrations or ((ex.prompt, ex.answer),)]


def padded(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels: the answer tokens, -100 elsewhere, attention mask), right-padded to the longest row."""
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        attn[i, :len(p) + len(a)] = 1
    return ids, labels, attn


def answer_loss_sum(model: torch.nn.Module, rows: list[Row], pad_id: int) -> torch.Tensor:
    """Σ −log p(answer token) over ``rows`` (next-token prediction, float32 log-softmax)."""
    device = next(model.parameters()).device
    ids, labels, attn = (t.to(device) for t in padded(rows, pad_id))
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def sft_warmup(model: torch.nn.Module, codec: TextCodec, data: Iterator[Example], steps: int,
               batch_size: int, lr: float, rank: int = 0, world: int = 1) -> list[float]:
    """Train on ``steps`` batches of prompt+answer+eos (loss on the answer only); returns the losses.
    With ``world`` > 1 (FSDP2) every rank takes its share of each batch and runs as many slices as the
    rank that needs most (the sharded model's collectives pair up by pass)."""
    if steps <= 0:
        return []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        rows = demonstration_rows(codec, [next(data) for _ in range(batch_size)][rank::world])
        rows.sort(key=lambda r: len(r[0]) + len(r[1]), reverse=True)
        count = slice_count([len(p) + len(a) for p, a in rows])
        if world > 1:
            count = int(all_reduce(count, dist.ReduceOp.MAX))
        answer_tokens = max(1, sum(len(a) for _, a in rows))
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for lo, hi in slice_bounds(len(rows), count):
            part = answer_loss_sum(model, rows[lo:hi] or rows[:1], codec.pad_id) / answer_tokens
            part = part if hi > lo else part * 0.0  # an empty slice: a pass that adds nothing
            part.backward()
            loss = loss + part.detach().cpu()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
    return losses
