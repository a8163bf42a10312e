"""Where a model's parameters are in its Hugging Face safetensors files, when not under their own names.

transformers (≥ 5) converts some checkpoints as it loads them (``transformers.conversion_mapping``),
and saves them back in the files' layout: a mixture of experts' per-expert tensors become one stacked
parameter per layer (Qwen2/3-MoE, Mixtral, DeepSeek-V3: ``…experts.gate_up_proj`` [E, 2I, H], row j =
[gate_j; up_j], from the files' ``…experts.j.gate_proj.weight`` and ``…experts.j.up_proj.weight``), and
some modules are renamed (Mixtral's ``.block_sparse_moe.`` is ``.mlp.``). A trainer that reads the
files itself (:mod:`.meta`) needs the same map:

- :func:`renaming` — a parameter's name in the files, for the conversions that only rename;
- :func:`stacked` — for each stacked parameter, the per-expert sources of its rows: row j of
  ``name`` is the concatenation along their first dimension of ``sources`` with ``*`` replaced by j
  (transformers' ``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` of the stacks).

Any other conversion is refused by name (:class:`UnsupportedConversion`), not guessed at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

EXPERT = "*"


class UnsupportedConversion(ValueError):
    """transformers converts this checkpoint in a way :mod:`.file_layout` does not map."""


def _conversions(model_type: str) -> list[Any]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _is_stacking(converter: Any) -> bool:
    """``MergeModulelist(dim=0)``, optionally followed by ``Concatenate(dim=1)``: per-expert tensors
    stacked, the sources' stacks side by side — row j is the sources' j-th tensors concatenated."""
    kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return kinds in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def renaming(model_type: str) -> Callable[[str], str]:
    """A parameter's name → its name in the files, for ``model_type``'s renaming conversions (plain
    substrings, the model's side replaced by the files')."""
    pairs: list[tuple[str, str]] = []
    for conversion in _conversions(model_type):
        if type(conversion).__name__ != "WeightRenaming":
            continue
        for source, target in zip(conversion.source_patterns, conversion.target_patterns, strict=True):
            if any(ch in source + target for ch in "*()[]^$\\|?+"):
                raise UnsupportedConversion(f"{model_type}: renaming {source!r} → {target!r} is a pattern")
            pairs.append((target, source))

    def in_files(name: str) -> str:
        for model_side, file_side in pairs:
            name = name.replace(model_side, file_side)
        return name

    return in_files


def stacked(model_type: str, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Of the parameter ``names`` (as the model has them), those ``model_type``'s checkpoint conversion
    stacks, each with its sources (model-side names, ``*`` for the expert index)."""
    out: dict[str, tuple[str, ...]] = {}
    names = list(names)
    for conversion in _conversions(model_type):
        if type(conversion).__name__ != "WeightConverter":
            continue
        if not _is_stacking(conversion) or len(conversion.target_patterns) != 1:
            raise UnsupportedConversion(f"{model_type}: converting {conversion.source_patterns} → "
                                        f"{conversion.target_patterns} by {conversion.operations}")
        target = conversion.target_patterns[0]
        for name in names:
            if name.endswith(target):
                prefix = name[: -len(target)]
                out[name] = tuple(prefix + source for source in conversion.source_patterns)
    return out


def source_names(sources: tuple[str, ...], row: int) -> list[str]:
    """Row ``row``'s tensors, in the order they are concatenated."""
    return [source.replace(EXPERT, str(row)) for source in sources]


def in_files(state: dict[str, torch.Tensor], model_type: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` (tensors under the model's names) in ``dtype``, laid out as ``model_type``'s files are —
    what ``save_pretrained`` writes: each stacked tensor split into its per-expert sources (row j's
    concatenation cut into equal parts), renamed modules under the files' names. Every tensor is a
    contiguous copy of its own (files hold no shared storage), cast piece by piece: the result and
    ``state`` are all it holds, never a cast copy of a stacked tensor beside its pieces."""
    to_file, stacks = renaming(model_type), stacked(model_type, state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        sources = stacks.get(name)
        if sources is None:
            out[to_file(name)] = tensor.to(dtype).contiguous()
            continue
        if tensor.shape[1] % len(sources):
            raise UnsupportedConversion(f"{name} {tuple(tensor.shape)} does not split into {len(sources)} sources")
        for row, joined in enumerate(tensor):
            for source, piece in zip(source_names(sources, row), joined.chunk(len(sources)), strict=True):
                out[to_file(source)] = piece.to(dtype, copy=True).contiguous()
    return out
