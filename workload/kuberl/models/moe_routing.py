"""A mixture of experts' routing, recorded where tokens are sampled and replayed where they are trained
(R3: the trainer reuses the experts the inference engine chose).

A router here is a Hugging Face top-k router (``Qwen3MoeTopKRouter`` and its kin): it maps a layer's
hidden states [tokens, hidden] to (router logits [tokens, E], the chosen experts' weights [tokens, k],
their indices [tokens, k]); tokens are the forward's [batch, positions] flattened row by row.

Routes of a sequence: [positions, layers, k] expert indices (int16 on the wire), −1 where unknown.

Replay: for the tokens whose route is known, the experts are the recorded ones and their weights are
recomputed from the trainer's own router (softmax over its logits, gathered at those experts,
renormalised over the k when the model does): the gradient reaches the router through the replayed
experts' weights. Tokens without a route (padding, a sequence's last token, a row the engine sent
none for) keep the trainer's own choice.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

UNKNOWN = -1
WIRE_DTYPE = "<i2"


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter)]


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward's routes are appended to the yielded list, one [tokens, k]
    tensor per router in layer order (on the host, int16)."""
    recorded: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
        recorded.append(output[2].detach().to("cpu", torch.int16))

    handles = [router.register_forward_hook(keep) for router in routers(model)]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def stacked(recorded: list[torch.Tensor], layers: int, rows: int) -> torch.Tensor:
    """What :func:`recording` kept of one forward over ``rows`` rows: [rows, positions, layers, k]."""
    if len(recorded) != layers:
        raise ValueError(f"recorded {len(recorded)} routers' routes, the model has {layers}")
    return torch.stack(recorded, dim=1).reshape(rows, -1, layers, recorded[0].shape[-1])


def replayed_experts(wanted: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[tokens, k]: the recorded experts ``wanted`` where a token's route is known (no −1), the router's
    ``own`` choice elsewhere — the one rule both backends replay by."""
    wanted = wanted.to(own.device, own.dtype)
    return torch.where((wanted >= 0).all(dim=-1, keepdim=True), wanted, own)


def _replayed(router: torch.nn.Module, layer: int, routes: torch.Tensor):
    """A forward hook that swaps the router's choice for ``routes[:, layer]`` where it is known."""
    def hook(_module: torch.nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, weights, own = output
        experts = replayed_experts(routes[:, layer], own)
        chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if getattr(router, "norm_topk_prob", False):
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return logits, chosen.to(weights.dtype), experts
    return hook


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the model's forwards route as ``routes`` says: [batch, positions, layers, k]
    for the forward's [batch, positions] input (None, no layers, or a dense model: nothing changes)."""
    found = [] if routes is None or routes.shape[2] == 0 else routers(model)  # no module walk without routes
    if not found or routes is None:
        yield
        return
    if routes.shape[2] != len(found):
        raise ValueError(f"routes for {routes.shape[2]} layers; the model routes in {len(found)}")
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3])
    # first among the hooks: the replayed choice is the router's output for every other hook
    handles = [r.register_forward_hook(_replayed(r, i, flat), prepend=True) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fitted(routes: torch.Tensor | None, positions: int) -> torch.Tensor | None:
    """``routes`` cut or grown (−1: unknown) to ``positions`` — a generation's routes for the episode it
    ends, whose last tokens may have been cut or followed by context the engine never routed."""
    if routes is None or routes.shape[0] == positions:
        return routes
    if routes.shape[0] > positions:
        return routes[:positions]
    grown = routes.new_full((positions, *routes.shape[1:]), UNKNOWN)
    grown[:routes.shape[0]] = routes
    return grown


def encode(routes: torch.Tensor) -> dict[str, Any]:
    """[positions, layers, k] → {"shape", "data": base64 of little-endian int16}."""
    array = routes.to(torch.int16).numpy().astype(WIRE_DTYPE)
    return {"shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode("ascii")}


def decode(wire: Any) -> torch.Tensor:
    """:func:`encode`'s output back to [positions, layers, k] int16; ValueError when malformed."""
    if not isinstance(wire, dict) or not isinstance(wire.get("data"), str) or not isinstance(wire.get("shape"), list):
        raise ValueError("routes must be an object with shape and data")
    shape = wire["shape"]
    if len(shape) != 3 or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError("routes.shape must be [positions, layers, k]")
    raw = base64.b64decode(wire["data"], validate=True)
    if len(raw) != 2 * int(np.prod(shape)):
        raise ValueError(f"routes.data holds {len(raw)} bytes, shape {shape} needs {2 * int(np.prod(shape))}")
    return torch.from_numpy(np.frombuffer(raw, dtype=WIRE_DTYPE).astype(np.int16).reshape(shape))
