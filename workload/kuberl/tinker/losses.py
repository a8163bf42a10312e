"""The Tinker API's built-in losses, per datum, as sums over its tokens.

Every datum has ``target_tokens`` (the next token at each input position, [N], or [N, K] several
candidates per position) and gets ``logprobs`` back: log π_θ(target) at each position, the same shape.
With r = exp(log π_θ − log q) (q: the sampler's ``logprobs``, the behaviour policy) and A the
``advantages``::

    cross_entropy        L = −Σ w · log π_θ(target)                        (w: ``weights``)
    importance_sampling  L = −Σ r · A
    ppo                  L = −Σ min(r · A, clip(r, lo, hi) · A)             (lo, hi: clip_low/high_threshold)
    cispo                L = −Σ sg(clip(r, lo, hi)) · A · log π_θ(target)    (sg: no gradient through it)

Sums, not means: a client that wants a mean puts 1/n in its weights or advantages, as Tinker's own
service does; the loss of a request is the sum over its datums (metric ``loss:sum``). ``lo``/``hi``
default to 0.8/1.2 and are ratios, not offsets from 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .errors import ClientError

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float | str]
LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]
CLIP_LOW, CLIP_HIGH = 0.8, 1.2


def _clip_bounds(config: Config) -> tuple[float, float]:
    low, high = config.get("clip_low_threshold", CLIP_LOW), config.get("clip_high_threshold", CLIP_HIGH)
    if not isinstance(low, float) or not isinstance(high, float) or not 0 <= low <= 1 <= high:
        raise ClientError(f"loss_fn_config: clip_low_threshold {low!r} and clip_high_threshold {high!r} "
                             "must be numbers with 0 ≤ low ≤ 1 ≤ high")
    return low, high


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def cross_entropy(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -(inputs["weights"] * logp).sum()


def importance_sampling(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -(_ratio(logp, inputs) * inputs["advantages"]).sum()


def ppo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip_bounds(config)
    ratio, advantages = _ratio(logp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages).sum()


def cispo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip_bounds(config)
    weight = _ratio(logp, inputs).clamp(low, high).detach()
    return -(weight * inputs["advantages"] * logp).sum()


LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
    "cispo": (cispo, ("logprobs", "advantages")),
}  # name → (loss, the inputs it reads besides target_tokens)


def loss_named(name: str) -> tuple[LossFn, tuple[str, ...]]:
    if name not in LOSSES:
        raise ClientError(f"loss_fn {name!r} is not served here; choose one of {sorted(LOSSES)} "
                             "(or forward_backward_custom, which runs on the client)")
    return LOSSES[name]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] at each position: logits [N, V], targets [N] or [N, K] → targets' shape."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.view(targets.shape[0], -1)).view(targets.shape)


def checked_inputs(name: str, inputs: Inputs, n_tokens: int, vocab: int,
                   index: int) -> dict[str, torch.Tensor]:
    """The datum's inputs for loss ``name``, checked: target_tokens [N] or [N, K] of ids < vocab, and each
    input the loss reads of target_tokens' shape (N: the datum's token count)."""
    _, needed = loss_named(name)
    where = f"data[{index}].loss_fn_inputs"
    missing = [key for key in ("target_tokens", *needed) if key not in inputs]
    if missing:
        raise ClientError(f"{where}: loss {name!r} needs {missing}")
    targets = inputs["target_tokens"].long()
    if targets.dim() not in (1, 2) or targets.shape[0] != n_tokens:
        raise ClientError(f"{where}.target_tokens: shape {list(targets.shape)}; the datum has {n_tokens} tokens, "
                             f"so [{n_tokens}] or [{n_tokens}, K]")
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        raise ClientError(f"{where}.target_tokens: ids must lie in [0, {vocab}), the model's vocabulary")
    checked = {"target_tokens": targets}
    for key in needed:
        value = inputs[key].float()
        if value.shape != targets.shape:
            raise ClientError(f"{where}.{key}: shape {list(value.shape)}, target_tokens' is {list(targets.shape)}")
        checked[key] = value
    return checked
