"""Dataset files and hub datasets, read with the ``datasets`` library: JSON Lines, JSON or Parquet
from a local path (``file://``, a claim), an ``s3://`` key (through the node-local cache),
``hf://datasets/ORG/NAME`` (config, split, revision) or a builtin table (``builtin.TABLES``). The
table is Arrow, memory-mapped from the cache: a row is read when it is drawn, never the whole file
into the trainer's memory.

Columns are named by dotted paths (``reward_model.ground_truth``). A prompt that is a list of
``{role, content}`` messages stays a chat (verl's ``prompt``, TRL's ``messages``); a text prompt
stays text. Every other column of the row travels to the reward.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..api.spec import DatasetSource
from ..remote import RemoteError, local_copy
from ..settings import Settings, hub_token
from .builtin import TABLES, table_file
from .example import Example, Message

if TYPE_CHECKING:
    import datasets

HUB_DATASETS = "hf://datasets/"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
RESERVED = ("prompt", "completion", "answer")  # the reward's own parameters: not passed again as columns


class DatasetError(ValueError):
    """spec.dataset cannot be read; the message names the field, file, row or column."""


def dataset_file(uri: str, settings: Settings) -> Path:
    """A local file: ``file://`` / plain paths as they are, ``s3://bucket/key`` via the cache, a builtin
    table written into the cache."""
    if uri.startswith("builtin:"):
        return table_file(uri.removeprefix("builtin:"), settings.cache_dir)
    if uri.startswith("s3://"):
        try:
            return local_copy(uri, settings)
        except RemoteError as err:
            raise DatasetError(f"spec.dataset.path: {err}") from err  # the error names the URI
    return Path(uri.removeprefix("file://"))


def load_table(source: DatasetSource, settings: Settings) -> datasets.Dataset:
    """The table ``source`` names (one split), its columns checked; raises DatasetError."""
    import datasets

    cache = str(settings.cache_dir / "datasets")
    try:
        if source.path.startswith(HUB_DATASETS):
            table = datasets.load_dataset(source.path.removeprefix(HUB_DATASETS), name=source.config,
                                          split=source.split, revision=source.revision, cache_dir=cache,
                                          token=hub_token(settings))
        else:
            path = dataset_file(source.path, settings)
            if not path.is_file():
                raise DatasetError(f"spec.dataset.path {source.path!r} does not exist")
            if path.suffix not in FORMATS:
                raise DatasetError(f"spec.dataset.path {source.path!r}: a {', '.join(FORMATS)} file is needed")
            table = datasets.load_dataset(FORMATS[path.suffix], data_files=str(path), split="train", cache_dir=cache)
    except DatasetError:
        raise
    except Exception as err:  # datasets' own errors: parse failures, a missing hub repo, no network
        raise DatasetError(f"spec.dataset.path {source.path!r}: {type(err).__name__}: {err}") from err
    if len(table) == 0:
        raise DatasetError(f"spec.dataset.path {source.path!r}: no rows")
    check_columns(source, column_paths(table.features))
    return table


def column_paths(features: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Every dotted path of a table's columns and of their nested fields (``features``: the table's
    ``datasets.Features``, or one row)."""
    out = set()
    for name, feature in features.items():
        out.add(prefix + name)
        if isinstance(feature, Mapping):
            out |= column_paths(feature, f"{prefix}{name}.")
    return out


def missing_columns(source: DatasetSource, columns: set[str]) -> list[tuple[str, str]]:
    """(key field, message) for ``promptKey`` / ``answerKey`` naming a column the table lacks."""
    shown = ", ".join(sorted(columns)[:20])
    keys = (("promptKey", source.prompt_key), ("answerKey", source.answer_key))
    return [(field, f"the table has no column {key!r}; it has: {shown}") for field, key in keys if key not in columns]


def check_columns(source: DatasetSource, columns: set[str]) -> None:
    """DatasetError naming ``spec.dataset.promptKey`` / ``answerKey`` when the table lacks them."""
    for field, message in missing_columns(source, columns)[:1]:
        raise DatasetError(f"spec.dataset.{field}: {message}")


def lookup(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        value = value[part] if isinstance(value, Mapping) else None
    return value


def as_prompt(value: Any, where: str) -> str | tuple[Message, ...]:
    """Text as it is; a list of ``{role, content}`` messages as a chat; anything else is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise DatasetError(f"{where}: a prompt is text or a list of {{role, content}} messages, got {str(value)[:80]!r}")


def as_answer(value: Any, where: str) -> str:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and len(value) == 1:  # some datasets keep one answer in a list
        return as_answer(value[0], where)
    raise DatasetError(f"{where}: an answer is text or a number, got {str(value)[:80]!r}")


def example_at(table: datasets.Dataset, index: int, source: DatasetSource) -> Example:
    """Row ``index`` as an Example: prompt and answer from their columns, the rest as ``row``."""
    row = table[index]
    where = f"spec.dataset.path {source.path!r} row {index}"
    prompt = as_prompt(lookup(row, source.prompt_key), f"{where}, promptKey {source.prompt_key!r}")
    answer = as_answer(lookup(row, source.answer_key), f"{where}, answerKey {source.answer_key!r}")
    rest = {k: v for k, v in row.items() if k not in RESERVED and k not in (source.prompt_key, source.answer_key)}
    return Example(prompt, answer, row=rest)


def peek_columns(path: Path) -> set[str]:
    """The dotted column paths of a local file without loading it: a Parquet file's schema, or the
    keys of a JSON Lines file's first ``PEEK_ROWS`` rows (a JSON array file: none, it must be parsed)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        from datasets import Features

        return column_paths(Features.from_arrow_schema(pq.read_schema(path)))
    if path.suffix != ".jsonl":
        return set()
    columns: set[str] = set()
    with path.open() as lines:
        for line in itertools.islice((ln for ln in lines if ln.strip()), PEEK_ROWS):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"spec.dataset.path {str(path)!r}: invalid JSON ({err.msg})") from err
            columns |= column_paths(row) if isinstance(row, dict) else set()
    return columns


PEEK_ROWS = 100


def local_file_issues(source: DatasetSource, field: str) -> list[tuple[str, str]]:
    """(field path, message) for what is wrong with ``source`` as far as this machine can tell without
    loading it: a local file (or builtin table) that lacks the prompt or answer column. Nothing when it
    looks right, or when the file is not here (a path on a claim or in S3: the trainer checks it when
    it starts)."""
    if source.path.startswith("builtin:"):
        name = source.path.removeprefix("builtin:")
        columns = column_paths(TABLES[name]()[0]) if name in TABLES else None
    elif source.path.startswith(("file://", "/")):
        path = Path(source.path.removeprefix("file://"))
        columns = peek_columns(path) if path.is_file() else None
    else:
        columns = None
    if not columns:
        return []
    return [(f"{field}.{key_field}", message) for key_field, message in missing_columns(source, columns)]
