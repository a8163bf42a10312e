"""The supervised warm start: sliced by row length, it takes the steps HF's own whole-batch loss takes."""

from __future__ import annotations

import copy
import itertools

import torch

from kuberl.api.spec import DatasetSource
from kuberl.data.datasets import examples
from kuberl.models.text import TextCodec
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.policy.batch import slice_count
from kuberl.policy.sft import demonstration_rows, padded, sft_warmup


def test_sft_in_length_sorted_slices_takes_the_steps_of_hfs_whole_batch_loss():
    """Multi-turn tool demonstrations (rows of very different lengths, so several slices): the
    losses and weights after three AdamW steps equal those of one pass per batch with HF's
    ``labels=`` loss (the mean over every answer token of the batch)."""
    tok = char_tokenizer()
    source = DatasetSource(path="builtin:multiplication-tools")
    rows = demonstration_rows(TextCodec(tok), list(itertools.islice(examples(source, 0), 32)))
    assert slice_count([len(p) + len(a) for p, a in rows]) > 1
    sliced = tiny_qwen2(len(tok), seed=0)
    whole = copy.deepcopy(sliced)
    got = sft_warmup(sliced, TextCodec(tok), examples(source, 0), 3, 32, 2e-3)

    optimizer, want = torch.optim.AdamW(whole.parameters(), lr=2e-3, weight_decay=0.0), []
    data = examples(source, 0)
    for _ in range(3):
        batch = demonstration_rows(TextCodec(tok), [next(data) for _ in range(32)])
        ids, labels, attn = padded(batch, tok.pad_token_id)
        loss = whole(input_ids=ids, attention_mask=attn, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(whole.parameters(), 1.0)
        optimizer.step()
        want.append(float(loss.detach()))
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)
    for (name, a), b in zip(sliced.state_dict().items(), whole.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
