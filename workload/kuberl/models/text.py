"""Text ↔ tokens, with the special-token rules in one place (SFT, rollout, the gateway and the
inference server all go through here, so the policy sees the same tokens whoever encodes):

- a single-turn prompt (text, or a chat of messages) goes through the chat template when
  ``spec.model.chatTemplate`` says so (mode auto: when the tokenizer has one), with the system prompt
  and template variables it gives; otherwise it is BOS (when the tokenizer has one) + the text, with
  no other special token;
- text inside an episode (a tool's output, a completion, an SFT answer) gets no special tokens;
- a completion the model finished ends with EOS (an SFT answer is trained to end so);
- chat messages render through the model's chat template, up to where the assistant's turn begins.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..api.sources import ChatTemplateMode, ChatTemplateSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | Sequence[dict[str, Any]]


class TextCodec:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: ChatTemplateSpec | None = None):
        """``chat``: how single-turn prompts are rendered (None: raw text after BOS, the gateway's and
        the inference server's text route)."""
        self.tokenizer = tokenizer
        self.bos_id: int | None = tokenizer.bos_token_id
        self.eos_id: int = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id
        self.chat = chat or ChatTemplateSpec(mode=ChatTemplateMode.OFF)
        if self.chat.mode == ChatTemplateMode.ON and not self.has_chat_template:
            raise ValueError("spec.model.chatTemplate.mode is on but the tokenizer has no chat template; give one "
                             "in spec.model.chatTemplate.template")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (a byte-level
        BPE entry has one character per byte, a SentencePiece or WordPiece entry at least as many as
        it decodes to). So a text of ``n`` characters is at least ``n / max_token_chars`` tokens for a
        tokenizer that keeps every character (byte-level BPE, SentencePiece: every chat model's)."""
        return max((len(token) for token in self.tokenizer.get_vocab()), default=1) or 1

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def uses_chat_template(self) -> bool:
        return self.chat.mode != ChatTemplateMode.OFF and self.has_chat_template

    def prompt_text(self, prompt: Prompt) -> str:
        """The text the policy is prompted with: the chat template's rendering (system prompt and
        variables applied, up to where the assistant's turn begins), or the raw text."""
        if not self.uses_chat_template:
            if not isinstance(prompt, str):
                raise ValueError("a chat-list prompt needs a chat template: the tokenizer has none, or "
                                 "spec.model.chatTemplate.mode is off (give spec.model.chatTemplate.template)")
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.chat.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.chat.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.chat.kwargs)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The chat template's rendering of ``prompt`` (which holds its own BOS), or BOS (if any) +
        the text's tokens."""
        if self.uses_chat_template:
            return self.encode_text(self.prompt_text(prompt))
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode_text(self.prompt_text(prompt))

    def encode_text(self, text: str) -> list[int]:
        """``text``'s tokens, no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_answer(self, text: str) -> list[int]:
        """A finished completion as the policy writes it: ``text``'s tokens + EOS."""
        return [*self.encode_text(text), self.eos_id]

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, exactly (special tokens kept)."""
        return self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """``messages`` through the chat template, ending where the assistant's next turn begins
        (the template already holds its BOS); whatever the template raises propagates."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode_text(text)
