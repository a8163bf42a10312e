"""``builtin:tiny-qwen2-arithmetic``: the tiny model pre-trained in code on single-digit addition,
a base that already knows its task's format, as a hub model knows language.

A LoRA adapter (``spec.trainer.lora``) adapts a model that already works; on a random model it has
nothing to adapt (60 supervised steps of an adapter leave ``builtin:tiny-qwen2`` at the loss it
started from). This base is ``tiny_qwen2`` after :data:`STEPS` full-batch steps of next-token
training on all 100 problems of ``builtin:arithmetic`` ('a+b=' → the sum, BOS before the prompt
and EOS after the answer, loss on the answer: how the rollout renders them), AdamW at :data:`LR`,
in float32 on one CPU thread and no sampling, so every process that builds it on the same kind of
CPU builds the same weights (trainer and replicas must hold the same base; on a cluster of mixed
CPUs, export it once and name its directory instead).
"""

from __future__ import annotations

import torch
from transformers import Qwen2ForCausalLM

from .tiny import char_tokenizer, tiny_qwen2

STEPS = 50
LR = 2e-3


def addition_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels, attention mask) of every 'a+b=' → 'a+b' with a, b in 0‥9, right-padded;
    labels are the answer's tokens and EOS, −100 elsewhere."""
    tok = char_tokenizer()
    rows = []
    for a in range(10):
        for b in range(10):
            prompt = [tok.bos_token_id, *tok.encode(f"{a}+{b}=", add_special_tokens=False)]
            rows.append((prompt, [*tok.encode(str(a + b), add_special_tokens=False), tok.eos_token_id]))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels, ids != tok.pad_token_id


BASE_SEED = 0  # a pre-trained model is one artifact, whatever the seed of the run that starts from it


def tiny_qwen2_arithmetic(vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    """``tiny_qwen2(vocab_size, BASE_SEED)`` pre-trained as the module docstring says (≈ 1 s); the
    run's ``seed`` is not used: every run starts from the same base."""
    model = tiny_qwen2(vocab_size, BASE_SEED)
    ids, labels, mask = addition_rows()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
        model.train()
        for _ in range(STEPS):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval().requires_grad_(True)
