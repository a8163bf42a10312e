"""Where a manifest's unknown field belongs: the fields of an object's schema by their YAML (camelCase)
paths, read from the pydantic models, for ``kuberl validate``'s "unknown field" messages."""

from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any

from pydantic import BaseModel

MAX_DEPTH = 8


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``, ``Annotated[X, …]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


@functools.cache
def field_paths(model: type[BaseModel], prefix: str = "", depth: int = 0) -> tuple[tuple[str, str], ...]:
    """(YAML name, dotted path) of every field under ``model``; lists add no index to the path."""
    out: list[tuple[str, str]] = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        path = f"{prefix}.{alias}" if prefix else alias
        out.append((alias, path))
        if depth < MAX_DEPTH:
            for inner in _models_in(info.annotation):
                out.extend(field_paths(inner, path, depth + 1))
    return tuple(out)


def _plain(path: str) -> str:
    return ".".join(part for part in path.split(".") if not part.isdigit())


def where_it_belongs(model: type[BaseModel], path: str) -> str | None:
    """A hint for the unknown field at ``path`` (dotted, list indexes allowed): the places this name is a
    field elsewhere in the schema, else the close spellings among its siblings; None when neither."""
    parent, _, name = _plain(path).rpartition(".")
    paths = field_paths(model)
    elsewhere = [p for alias, p in paths if alias == name and p.rpartition(".")[0] != parent]
    if elsewhere:
        return f"it is a field of {', '.join(p.rpartition('.')[0] or 'the object' for p in elsewhere[:3])}"
    siblings = [alias for alias, p in paths if p.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(name, siblings, n=2, cutoff=0.75)
    return f"did you mean {' or '.join(close)}?" if close else None
