"""Parse AReaL-style allocation strings.

Grammar (KubeRL runs disaggregated, so both halves are required)::

    allocation := inference "+" trainer
    inference  := ENGINE ":" dims                     e.g. vllm:d4t4
    trainer    := [BACKEND ":"] dims                  e.g. fsdp:d8, d8
               |  "megatron:(attn:" dims "|ffn:" dims ")"   (MoE form)
    dims       := (LETTER INT)+  with LETTER in d t p c e, each at most once

The letters mean data, tensor, pipeline, context and expert parallel degree. A missing letter
is 1. For inference, ``d`` is the number of replicas and ``t``/``p`` the per-replica tensor and
pipeline degrees. Everything here is pure: strings in, dataclasses or ``AllocationError`` out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INFERENCE_ENGINES = ("vllm", "torch")
TRAINER_BACKENDS = ("fsdp", "megatron")
_DIM_LETTERS = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_INFERENCE_LETTERS = frozenset("dtp")
_FSDP_LETTERS = frozenset("dc")
_DIMS_RE = re.compile(r"([a-z])(\d+)")
_MOE_RE = re.compile(r"^\(attn:([a-z0-9]+)\|ffn:([a-z0-9]+)\)$")


class AllocationError(ValueError):
    """A malformed allocation string; the message says what is allowed."""


@dataclass(frozen=True)
class Dims:
    """Parallel degrees; every field is ≥ 1."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

    @property
    def world_size(self) -> int:
        """Devices covered by these degrees: d·t·p·c·e."""
        return self.data * self.tensor * self.pipeline * self.context * self.expert


@dataclass(frozen=True)
class InferenceAllocation:
    engine: str
    dims: Dims

    @property
    def devices(self) -> int:
        return self.dims.world_size


@dataclass(frozen=True)
class TrainerAllocation:
    backend: str
    attn: Dims
    ffn: Dims | None = None  # only for the MoE form

    @property
    def devices(self) -> int:
        return self.attn.world_size


@dataclass(frozen=True)
class Allocation:
    inference: InferenceAllocation
    trainer: TrainerAllocation


MAX_DEGREE = 65536  # far beyond any cluster; keeps absurd numbers from reaching arithmetic


def parse_dims(text: str, allowed: frozenset[str], where: str) -> Dims:
    """Parse ``d4t2``-style degrees, allowing only the letters in ``allowed``."""
    allowed_list = ", ".join(sorted(allowed))
    if not text or _DIMS_RE.sub("", text):
        raise AllocationError(
            f"{where}: {text!r} is not a list of degrees like 'd4t2' (letters: {allowed_list})"
        )
    values: dict[str, int] = {}
    for letter, number in _DIMS_RE.findall(text):
        if letter not in allowed:
            raise AllocationError(f"{where}: degree {letter!r} is not allowed; use {allowed_list}")
        if letter in values:
            raise AllocationError(f"{where}: degree {letter!r} is given twice in {text!r}")
        if len(number) > len(str(MAX_DEGREE)) or not 1 <= int(number) <= MAX_DEGREE:
            raise AllocationError(f"{where}: degree {letter}{number[:12]}{'…' if len(number) > 12 else ''} must be "
                                  f"between 1 and {MAX_DEGREE}")
        values[letter] = int(number)
    return Dims(**{_DIM_LETTERS[k]: v for k, v in values.items()})


def _parse_inference(text: str) -> InferenceAllocation:
    engine, sep, dims = text.partition(":")
    if not sep or engine not in INFERENCE_ENGINES:
        raise AllocationError(
            f"inference part {text!r} must be ENGINE:DIMS with ENGINE one of "
            f"{', '.join(INFERENCE_ENGINES)} (e.g. 'vllm:d4t4')"
        )
    return InferenceAllocation(engine, parse_dims(dims, _INFERENCE_LETTERS, "inference"))


def _parse_trainer(text: str) -> TrainerAllocation:
    backend, sep, dims = text.partition(":")
    if not sep:
        backend, dims = "fsdp", text
    if backend not in TRAINER_BACKENDS:
        raise AllocationError(
            f"trainer part {text!r} must be [BACKEND:]DIMS with BACKEND one of "
            f"{', '.join(TRAINER_BACKENDS)}"
        )
    if backend == "fsdp":
        return TrainerAllocation("fsdp", parse_dims(dims, _FSDP_LETTERS, "trainer (fsdp)"))
    all_letters = frozenset(_DIM_LETTERS)
    moe = _MOE_RE.match(dims)
    if not moe:
        if dims.startswith("("):
            raise AllocationError(
                f"trainer part {text!r}: the MoE form is 'megatron:(attn:DIMS|ffn:DIMS)'"
            )
        return TrainerAllocation("megatron", parse_dims(dims, all_letters - {"e"}, "trainer"))
    attn = parse_dims(moe.group(1), all_letters - {"e"}, "trainer attn")
    ffn = parse_dims(moe.group(2), frozenset("dtpe"), "trainer ffn")
    if attn.pipeline != ffn.pipeline:
        raise AllocationError(
            f"trainer: attn and ffn must use the same pipeline degree "
            f"(attn p{attn.pipeline}, ffn p{ffn.pipeline})"
        )
    if attn.world_size != ffn.world_size:
        raise AllocationError(
            f"trainer: attn covers {attn.world_size} devices but ffn covers {ffn.world_size}; "
            "they must be equal"
        )
    return TrainerAllocation("megatron", attn, ffn)


def parse_allocation(text: str) -> Allocation:
    """Parse ``INFERENCE+TRAINER``; raise ``AllocationError`` naming what is wrong."""
    compact = text.replace(" ", "")
    parts = compact.split("+")
    if len(parts) != 2 or not all(parts):
        raise AllocationError(
            f"{text!r} must be '<inference>+<trainer>', e.g. 'vllm:d4t4+fsdp:d8' or "
            "'vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)'"
        )
    return Allocation(_parse_inference(parts[0]), _parse_trainer(parts[1]))
