"""Text ↔ tokens, with the special-token rules in one place (SFT, rollout, the gateway and the
inference server all go through here, so the policy sees the same tokens whoever encodes):

- a prompt starts with BOS when the tokenizer has one, and carries no other special token;
- text inside an episode (a tool's output, a completion, an SFT answer) gets no special tokens;
- a completion the model finished ends with EOS (an SFT answer is trained to end so);
- chat messages render through the model's chat template, up to where the assistant's turn begins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextCodec:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.bos_id: int | None = tokenizer.bos_token_id
        self.eos_id: int = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> list[int]:
        """BOS (if any) + ``text``'s tokens."""
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode_text(text)

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
