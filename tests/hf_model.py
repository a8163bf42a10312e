"""A small Hugging Face-format model directory written by the tests: a tiny Qwen2 and a real fast
(BPE) tokenizer trained here with the ``tokenizers`` package, saved with a chat template — the
files a user's ``s3://`` model prefix holds, without any hub."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kuberl.models.tiny import tiny_qwen2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)] + ["what is the sum of these numbers"] * 20


def bpe_tokenizer(vocab_size: int = 120) -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_hf_model(directory: Path, seed: int = 5, tied: bool = True) -> Path:
    """config.json, model.safetensors and the tokenizer files (with the chat template) in ``directory``."""
    tok = bpe_tokenizer()
    model = tiny_qwen2(len(tok), seed=seed, tied=tied)
    model.config.eos_token_id, model.config.bos_token_id = tok.eos_token_id, tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
