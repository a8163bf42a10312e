"""A sampler: one fixed set of weights served by the torch engine (:class:`kuberl.inference.engine.TorchEngine`).

A sampler of the base model serves it as loaded; one saved from a training model serves the base with that
model's weights at the moment of the save — its adapter on the shared base, or a copy with all of them —
so later training never changes what it samples. Samples of one request run as one batch; a sequence ends at
the model's end-of-sequence token, at a stop token or string of the request (kept in the output, stop
reason "stop"), or after ``max_tokens`` (reason "length"). Log-probs are under the request's
temperature (greedy at 0). Prompt log-probs are log π(token_i | tokens_<i), NaN for the first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..inference.contract import FINISH_STOP, SamplingParams
from ..inference.engine import TorchEngine
from .errors import ClientError
from .losses import target_logprobs
from .trainee import AdapterShape, adapted
from .wire import SequenceOut


@dataclass(frozen=True)
class SampleParams:
    """A request's ``sampling_params``, checked (top-k and per-request seeds are refused before here)."""

    max_tokens: int | None  # None: as many as the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def cut_at_stop(tokens: list[int], params: SampleParams, decode: Callable[[list[int]], str]) -> int | None:
    """The length of the shortest prefix of ``tokens`` that ends in a stop token or whose text contains a
    stop string; None when there is none."""
    for length in range(1, len(tokens) + 1):
        if tokens[length - 1] in params.stop_tokens:
            return length
        if params.stop_strings and any(s in decode(tokens[:length]) for s in params.stop_strings):
            return length
    return None


class Sampler:
    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, decode: Callable[[list[int]], str],
                 seed: int, base_model: str, model_path: str | None):
        self.model = model.eval()
        self.engine = TorchEngine(self.model, eos_id, pad_id, seed=seed)
        self.decode, self.base_model, self.model_path = decode, base_model, model_path
        self.max_len = self.engine.max_model_len

    @classmethod
    def of_weights(cls, base: torch.nn.Module, adapter: AdapterShape | None, weights: dict[str, torch.Tensor],
                   **kwargs: object) -> Sampler:
        model = adapted(base, adapter)
        model.load_state_dict(weights, strict=adapter is None)
        return cls(model, **kwargs)  # type: ignore[arg-type]

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def check_prompt(self, prompt: list[int]) -> None:
        vocab = self.engine.vocab_size
        if not prompt:
            raise ClientError("prompt: no tokens")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ClientError(f"prompt: token ids must lie in [0, {vocab}), the model's vocabulary")
        if len(prompt) >= self.max_len:
            raise ClientError(f"prompt: {len(prompt)} tokens leave no room in the model's {self.max_len}")

    async def sample(self, prompt: list[int], n: int, params: SampleParams) -> list[SequenceOut]:
        assert params.max_tokens is not None  # the service fills it in from the room the prompt leaves
        engine_params = SamplingParams(max_new_tokens=params.max_tokens, temperature=params.temperature,
                                       top_p=params.top_p)
        generations = await asyncio.gather(*(self.engine.generate(prompt, engine_params) for _ in range(n)))
        sequences = []
        for gen in generations:
            tokens, logprobs, stopped = gen.output_ids, gen.logprobs, gen.finish_reason == FINISH_STOP
            cut = cut_at_stop(tokens, params, self.decode)
            if cut is not None:
                tokens, logprobs, stopped = tokens[:cut], logprobs[:cut], True
            sequences.append(SequenceOut(list(tokens), list(logprobs), stopped))
        return sequences

    async def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        def score() -> list[float]:
            ids = torch.tensor([prompt], device=self.engine.model.device)
            with torch.no_grad():
                logp = target_logprobs(self.model(input_ids=ids).logits[0, :-1], ids[0, 1:])
            return [float("nan"), *logp.cpu().tolist()]

        return await asyncio.to_thread(score)
