"""The embedded ``torch`` engine: continuous batching over a transformers causal LM.

Every engine step runs one forward pass over all active sequences (left-padded) and samples one
token for each; requests join and leave between steps, so a batch is never drained before new
work starts. Each generated token carries its behaviour log-prob (under the temperature-scaled
distribution the token was sampled from) and the weight version that produced it.

``pause()`` aborts in-flight requests: they complete with ``finish_reason="abort"`` and the
tokens generated so far, so the client can resume them (prompt + partial output) under the next
weights. New requests wait while paused. ``load_weights()`` swaps the parameters and bumps the
version atomically between steps, without interrupting anything. No KV cache: each step
recomputes the whole (short) sequences, which is simple and exact for the small models this
engine is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..devices import WIRE_DTYPE
from .contract import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams

log = logging.getLogger("kuberl.inference")

@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]
    out: Generation = field(default_factory=Generation)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, log-probs under the temperature-scaled softmax).

    Temperature 0 is greedy. Top-p keeps the smallest prefix of tokens (by probability) whose mass
    reaches p before sampling; the reported log-prob stays that of the temperature-scaled policy.
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logp = torch.log_softmax(scaled.float(), dim=-1)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p.unsqueeze(-1)
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class TorchEngine:
    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, max_batch: int = 256, seed: int = 0):
        self.model = model.eval()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_id, self.pad_id, self.max_batch = eos_id, pad_id, max_batch
        self.version = 0
        self.generated_tokens = 0
        self.aborted = 0
        self._queue: list[_Request] = []
        self._active: list[_Request] = []
        self._paused = False
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self._task: asyncio.Task[None] | None = None

    # -- public API ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="torch-engine")
        self._task.add_done_callback(self._on_loop_exit)

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """A crashed engine fails every waiting request loudly instead of leaving it hanging."""
        if task.cancelled():
            return
        err = task.exception()
        if err is None:
            return
        log.error("engine loop crashed: %r", err)
        for req in self._queue + self._active:
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"inference engine crashed: {err!r}"))
        self._queue, self._active = [], []

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight(self) -> int:
        return len(self._queue) + len(self._active)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(list(prompt_ids), params, future))
        self._wake.set()
        return await future

    async def pause(self) -> int:
        """Stop generating; abort in-flight requests with their partial output. Returns how many."""
        self._paused = True
        async with self._step_lock:  # let the current step finish
            aborted = self._active
            self._active = []
        for req in aborted:
            self._finish(req, FINISH_ABORT)
        self.aborted += len(aborted)
        return len(aborted)

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the parameters and set the version atomically, between two engine steps.

        In-flight requests are not interrupted: their next token is sampled by the new weights and
        records the new version. (This engine keeps no KV cache, so continuing is exact; an engine
        with a cache of old-weight keys/values pauses with abort first and lets the client resume.)
        """
        async with self._step_lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
            self.version = version

    def parameter_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """What the p2p exchange sends: every parameter in the wire dtype (cast on receipt)."""
        return {name: (p.shape, WIRE_DTYPE) for name, p in self.model.named_parameters()}

    async def receive_parameters(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``tensors`` into the parameters of the same names and set the version, between two
        engine steps (the p2p path: names are parameter names, tied weights appear once)."""
        params = dict(self.model.named_parameters())
        async with self._step_lock:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    params[name].copy_(tensor)
            self.version = version

    # -- the loop ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if self._paused or not (self._queue or self._active):
                self._wake.clear()
                await self._wake.wait()
                continue
            room = self.max_batch - len(self._active)
            self._active += self._queue[:room]
            del self._queue[:room]
            async with self._step_lock:
                # pause() may have taken the lock first and aborted what we just activated.
                batch = list(self._active)
                if self._paused or not batch:
                    continue
                version = self.version
                tokens, logps = await asyncio.to_thread(self._forward, batch)
                for req, tok, lp in zip(batch, tokens.tolist(), logps.tolist(), strict=True):
                    if req.future.done():
                        continue
                    req.out.output_ids.append(tok)
                    req.out.logprobs.append(lp)
                    req.out.versions.append(version)
                    self.generated_tokens += 1
                    if tok == self.eos_id:
                        self._finish(req, FINISH_STOP)
                    elif len(req.out.output_ids) >= req.params.max_new_tokens:
                        self._finish(req, FINISH_LENGTH)
                self._active = [r for r in self._active if not r.future.done()]

    @torch.no_grad()
    def _forward(self, batch: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [r.prompt_ids + r.out.output_ids for r in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.model.device
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device)).logits[:, -1, :].float().cpu()
        temperature = torch.tensor([r.params.temperature for r in batch])
        top_p = torch.tensor([r.params.top_p for r in batch])
        return sample_tokens(logits, temperature, top_p, self._generator)

    @staticmethod
    def _finish(req: _Request, reason: str) -> None:
        if not req.future.done():
            req.out.finish_reason = reason
            req.future.set_result(req.out)
