"""Which layers a pipeline stage holds, and their names there (pure).

With pipeline parallelism ``p`` over ``n`` transformer layers, stage s holds the consecutive layers
``[s·n/p, (s+1)·n/p)`` as Megatron's ``decoder.layers.0 … decoder.layers.{n/p−1}`` (global layer
``g`` is local ``g − s·n/p``); the first stage also holds the word embedding, the last the final norm
and the output layer. With tied embeddings and more than one stage the last stage holds its own
copy of the embedding as ``output_layer.weight`` (Megatron's ``shared_embedding``): loaded from the
same tensor, and its gradient summed with the first stage's after every backward (the embedding
group), so the two copies stay equal.
"""

from __future__ import annotations

import re

import torch

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def layers_per_stage(layers: int, stages: int) -> int:
    """n ÷ p; raises when the layers do not split evenly over the stages."""
    if layers % stages:
        raise ValueError(f"{layers} layers do not split evenly over {stages} pipeline stages")
    return layers // stages


def stage_globals(stage: int, stages: int, tied: bool) -> frozenset[str]:
    """The tensors outside the layers that stage ``stage`` of ``stages`` is built from: the first, the
    embedding; the last, the final norm and the output layer — the embedding when ``tied``."""
    names = {EMBEDDING} if stage == 0 else set()
    if stage == stages - 1:
        names |= {FINAL_NORM, EMBEDDING if tied else OUTPUT_LAYER}
    return frozenset(names)


def _renumbered(name: str, shift: int) -> str:
    match = _LAYER.fullmatch(name)
    return name if match is None else f"decoder.layers.{int(match[1]) + shift}.{match[2]}"


def stage_state(state: dict[str, torch.Tensor], layers: int, stage: int, stages: int,
                tied: bool) -> dict[str, torch.Tensor]:
    """A whole-model Megatron state dict, or a piece of one (global layer numbers, no output layer
    when ``tied``) → what stage ``stage`` of ``stages`` holds of it, its layers numbered from 0 (a
    tied last stage's output layer: the embedding, where ``state`` holds it)."""
    per_stage = layers_per_stage(layers, stages)
    first, last = stage == 0, stage == stages - 1
    out = {}
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if match is not None:
            if stage * per_stage <= int(match[1]) < (stage + 1) * per_stage:
                out[_renumbered(name, -stage * per_stage)] = tensor
        elif (name == EMBEDDING and first) or (name in (FINAL_NORM, OUTPUT_LAYER) and last):
            out[name] = tensor
    if tied and last and not first and EMBEDDING in state:
        out[OUTPUT_LAYER] = state[EMBEDDING]
    return out


def global_state(state: dict[str, torch.Tensor], layers: int, stage: int, stages: int,
                 tied: bool) -> dict[str, torch.Tensor]:
    """Inverse of :func:`stage_state` for one stage: its layers under global numbers; a tied last
    stage's copy of the embedding dropped (the first stage's is the one)."""
    shift = stage * layers_per_stage(layers, stages)
    return {_renumbered(name, shift): tensor for name, tensor in state.items()
            if not (tied and name == OUTPUT_LAYER and stage > 0)}  # fmt: skip


