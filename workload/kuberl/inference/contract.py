"""What every inference engine offers the HTTP server (:mod:`kuberl.inference.server`).

Two engines implement :class:`Engine`: the embedded ``torch`` engine (:mod:`.engine`) and the
``vllm`` adapter (:mod:`.vllm_engine`). Every generated token carries its behaviour log-prob
(under the temperature-scaled distribution it was sampled from) and the weight version that
produced it. ``pause()`` aborts in-flight requests: they finish with ``FINISH_ABORT`` and the
tokens generated so far, so the client resumes them (prompt + partial output) under new weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the rollout process reads replies without torch unless routes come with them
    import torch

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
MAX_PROMPT_TOKENS = 131072  # token ids a request's prompt may have (the server refuses more; the gateway too)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    return_routes: bool = False  # a mixture of experts' routes with the output (:mod:`kuberl.models.moe_routing`)


FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)


class EngineDown(RuntimeError):
    """The engine cannot serve (its loop or core is gone, or its weights are unknown): the request is
    answered 503 at once instead of waiting for work nobody will do."""


@dataclass
class Generation:
    """One completion, and its wire form in ``POST /generate``'s reply (one type on both sides)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    resumed: int = 0  # client side: how often it was resumed after a pause (weight update)
    routes: torch.Tensor | None = None  # asked for: [prompt + output − 1 positions, MoE layers, k] experts

    def to_json(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"output_ids": self.output_ids, "logprobs": self.logprobs, "versions": self.versions,
                                "finish_reason": self.finish_reason}
        if self.routes is not None:
            from ..models import moe_routing

            wire["routes"] = moe_routing.encode(self.routes)
        return wire

    @staticmethod
    def from_json(data: Any) -> Generation:
        """A reply's output, checked: ValueError when a server answers something else."""
        if not isinstance(data, dict):
            raise ValueError("a generation must be a JSON object")
        ids, logprobs, versions = data.get("output_ids"), data.get("logprobs"), data.get("versions")
        reason = data.get("finish_reason")
        # the element checks compare types in C (map, set): per token, a generator of isinstance calls
        # was the rollout client's largest single cost (≈ 12 % of its CPU in the main example)
        if not (isinstance(ids, list) and isinstance(logprobs, list) and isinstance(versions, list)
                and len(ids) == len(logprobs) == len(versions) and reason in FINISH_REASONS
                and set(map(type, ids)) | set(map(type, versions)) <= {int}
                and set(map(type, logprobs)) <= {int, float}):
            raise ValueError("a generation needs output_ids, logprobs and versions of one length and a finish_reason "
                             f"in {FINISH_REASONS}")
        routes = None
        if data.get("routes") is not None:
            from ..models import moe_routing

            routes = moe_routing.decode(data["routes"])
        return Generation(list(ids), list(map(float, logprobs)), list(versions), reason, routes=routes)

    def then(self, more: Generation) -> Generation:
        """This partial (aborted) generation continued by ``more``: each token keeps its version; the
        routes are ``more``'s (its prefill routed the whole sequence again)."""
        return Generation(self.output_ids + more.output_ids, self.logprobs + more.logprobs,
                          self.versions + more.versions, more.finish_reason, self.resumed + 1, more.routes)


@dataclass
class GenerateReply:
    """``POST /generate``'s reply: the version served when it was answered, and n generations."""

    version: int
    outputs: list[Generation]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "outputs": [g.to_json() for g in self.outputs]}

    @staticmethod
    def from_json(data: Any) -> GenerateReply:
        if not isinstance(data, dict) or not isinstance(data.get("version"), int) or not isinstance(
                data.get("outputs"), list):
            raise ValueError("a /generate reply needs a version and a list of outputs")
        return GenerateReply(data["version"], [Generation.from_json(o) for o in data["outputs"]])


@dataclass(frozen=True)
class ReplyLimits:
    """What a ``/generate`` reply may hold for the model being trained: token ids in ``[0, vocab_size)``
    (the trainer's embedding rows: an id past them is a device-side assert on a GPU), and, for a mixture
    of experts, routes of ``[positions ≤ prompt + output, moe_layers, top_k]`` experts in
    ``[0, experts)`` or −1 (unknown). The rollout client treats a reply outside them as its replica's
    fault (:meth:`problem`)."""

    vocab_size: int
    moe_layers: int = 0
    top_k: int = 0
    experts: int = 0

    @staticmethod
    def of(model: torch.nn.Module) -> ReplyLimits:
        """The limits of ``model`` (its modules alone: a model on ``meta`` will do)."""
        import torch

        from ..models import moe_routing

        embedding = model.get_input_embeddings()
        assert isinstance(embedding, torch.nn.Embedding)
        routers = moe_routing.routers(model)
        if not routers:
            return ReplyLimits(embedding.num_embeddings)
        return ReplyLimits(embedding.num_embeddings, len(routers), int(routers[0].top_k), int(routers[0].num_experts))

    def problem(self, reply: GenerateReply, n: int, prompt_tokens: int) -> str | None:
        """Why ``reply`` to a request for ``n`` generations of a ``prompt_tokens`` prompt cannot be from
        this model, or None."""
        if len(reply.outputs) != n:
            return f"answered {len(reply.outputs)} generations to a request for {n}"
        for out in reply.outputs:
            if out.output_ids and (min(out.output_ids) < 0 or max(out.output_ids) >= self.vocab_size):
                bad = next(t for t in out.output_ids if not 0 <= t < self.vocab_size)
                return f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
            tokens = prompt_tokens + len(out.output_ids)
            if out.routes is not None and (why := self._routes_problem(out.routes, tokens)):
                return why
        return None

    def _routes_problem(self, routes: torch.Tensor, tokens: int) -> str | None:
        if self.moe_layers == 0:
            return "sent routes for a model without experts"
        from ..models import moe_routing

        positions, layers, k = routes.shape
        if (layers, k) != (self.moe_layers, self.top_k) or positions > tokens:
            return (f"routes of shape {list(routes.shape)}; the model routes at most {tokens} positions through "
                    f"{self.moe_layers} layers, {self.top_k} experts each")
        if routes.numel() and (int(routes.min()) < moe_routing.UNKNOWN or int(routes.max()) >= self.experts):
            return f"routes name experts outside [0, {self.experts})"
        return None


class Engine(Protocol):
    version: int
    generated_tokens: int
    aborted: int
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_model_len: int  # prompt + generated tokens of one sequence never exceed this

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def health(self) -> str | None:
        """None when the engine serves; otherwise why it cannot (what ``/health`` answers with 503)."""
        ...
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
