"""A tiny Qwen2-style causal LM and a character tokenizer, built in code (no hub, no files).

``builtin:tiny-qwen2``: 2 layers, hidden 128, a vocabulary of the task's characters (~20 tokens).
``builtin:tiny-qwen2-chat``: the same model with a chat template (``chat_tokenizer``: role tokens).
``builtin:tiny-qwen3-moe``: the same size shaped like Qwen3-MoE — q/k norms, and in every layer 4
experts of which each token takes 2 (their width together the dense model's MLP width).
Random init from the experiment's seed; it generates thousands of tokens per second and trains
a step in tens of milliseconds on one CPU core, which is what CI and laptops need.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
ALPHABET = "0123456789+-*/=()?.,: abcdefghijklmnopqrstuvwxyz"


def char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character; <bos> is prepended by the caller's template, <eos> ends answers."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        padding_side="left",
    )


CHAT_ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """``char_tokenizer`` plus one token per chat role and ``CHAT_TEMPLATE``: a real chat template
    (BOS, a role token before each message, an end token after it) on a vocabulary of ~60 tokens."""
    tok = char_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": CHAT_ROLES})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen2(vocab_size: int, seed: int, hidden: int = 128, layers: int = 2, tied: bool = True) -> Qwen2ForCausalLM:
    """``tied``: the output layer shares the embedding matrix (as in small Qwen2 models)."""
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, architectures=["Qwen2ForCausalLM"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def tiny_qwen3_moe(vocab_size: int, seed: int, hidden: int = 128, layers: int = 2, experts: int = 4,
                   top_k: int = 2) -> Qwen3MoeForCausalLM:
    """A mixture of experts in every layer (``experts`` experts, each token routed to ``top_k``,
    renormalised; each expert 2 × hidden ÷ top_k wide, so a token's experts together are the dense
    MLP's width), tied embeddings."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=2 * hidden // top_k, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        architectures=["Qwen3MoeForCausalLM"],  # as a hub config names it: vLLM picks its model class by it
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)
