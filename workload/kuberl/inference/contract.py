"""What every inference engine offers the HTTP server (:mod:`kuberl.inference.server`).

Two engines implement :class:`Engine`: the embedded ``torch`` engine (:mod:`.engine`) and the
``vllm`` adapter (:mod:`.vllm_engine`). Every generated token carries its behaviour log-prob
(under the temperature-scaled distribution it was sampled from) and the weight version that
produced it. ``pause()`` aborts in-flight requests: they finish with ``FINISH_ABORT`` and the
tokens generated so far, so the client resumes them (prompt + partial output) under new weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Generation:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Engine(Protocol):
    version: int
    generated_tokens: int
    aborted: int
    vocab_size: int  # token ids must lie in [0, vocab_size)

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def paused(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...
    async def pause(self) -> int:
        """Stop generating; abort in-flight requests with their partial output. Returns how many."""
        ...
    def resume(self) -> None: ...
    async def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Serve ``state`` (Hugging Face parameter names, full tensors) as ``version`` from now on.

        No token generated under the old weights is ever stamped with the new version."""
        ...
    def parameter_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every parameter the trainer sends, by Hugging Face name (tied once):
        what a p2p receiver allocates to receive into."""
        ...
    async def receive_parameters(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Serve the received ``tensors`` (names as in :meth:`parameter_layout`) as ``version``."""
        ...
