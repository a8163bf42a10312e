"""Prompt/answer datasets: ``builtin:arithmetic`` (generated, seeded) and JSONL files (local, or
``s3://bucket/key.jsonl`` through the node-local cache).

A dataset is an endless, deterministic stream of ``Example(prompt, answer)``: the same seed gives
the same order, and ``position`` lets a resumed run continue where it stopped.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..api.spec import DatasetSource
from ..remote import RemoteError, local_copy
from ..settings import DEFAULTS, Settings


class DatasetError(ValueError):
    """spec.dataset cannot be read; the message names the file, line or key."""


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    # (prompt, completion) pairs the SFT warm-up trains on instead of (prompt, answer): e.g. the turns
    # of a tool-using episode
    demonstrations: tuple[tuple[str, str], ...] = ()


def arithmetic(rng: random.Random) -> Example:
    """Single-digit addition, 'a+b=' → 'a+b' (100 distinct problems)."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Example(f"{a}+{b}=", str(a + b))


def two_digit(rng: random.Random) -> Example:
    """'ab+c=' → the sum (two-digit plus one-digit)."""
    a, b = rng.randint(10, 99), rng.randint(0, 9)
    return Example(f"{a}+{b}=", str(a + b))


def three_digit(rng: random.Random) -> Example:
    """'abc+de=' → the sum (three-digit plus two-digit): longer answers than the others."""
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return Example(f"{a}+{b}=", str(a + b))


def tool_multiplication(rng: random.Random) -> Example:
    """'ab*cd=' → the product, a task for a calculator: the tiny model cannot multiply, but it can
    learn to call ``calc(ab*cd)`` and copy the tool's answer (``=P=``, ``kuberl.agent.workflow``).
    The demonstrations show both turns: a short warm-up leaves the copying unreliable, for RL."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    prompt, call = f"{a}*{b}=", f"calc({a}*{b})"
    return Example(prompt, str(a * b), demonstrations=((prompt, call), (f"{prompt}{call}={a * b}=", str(a * b))))


BUILTIN = {"arithmetic": arithmetic, "arithmetic-2digit": two_digit, "arithmetic-3digit": three_digit,
           "multiplication-tools": tool_multiplication}


def read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[Example]:
    if not path.is_file():
        raise DatasetError(f"spec.dataset.path {str(path)!r} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{n}: invalid JSON ({err.msg})") from err
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise DatasetError(f"{path}:{n}: missing key(s) {missing}; set spec.dataset.promptKey/answerKey")
        out.append(Example(str(row[prompt_key]), str(row[answer_key])))
    if not out:
        raise DatasetError(f"{path}: no examples")
    return out


def dataset_file(uri: str, settings: Settings) -> Path:
    """A local JSONL file: ``file://`` / plain paths as they are, ``s3://bucket/key`` via the cache."""
    if uri.startswith("s3://"):
        try:
            return local_copy(uri, settings)
        except RemoteError as err:
            raise DatasetError(f"spec.dataset.path: {err}") from err  # the error names the URI
    return Path(uri.removeprefix("file://"))


def examples(source: DatasetSource, seed: int, position: int = 0, settings: Settings = DEFAULTS) -> Iterator[Example]:
    """Endless deterministic stream starting after ``position`` examples (an s3:// file through
    ``settings``' cache and endpoint)."""
    rng = random.Random(seed)
    if source.path.startswith("builtin:"):
        name = source.path.removeprefix("builtin:")
        if name not in BUILTIN:
            raise DatasetError(f"spec.dataset.path {source.path!r}; builtin datasets: {', '.join(BUILTIN)}")
        make = BUILTIN[name]
        for i in range(10**12):
            ex = make(rng)
            if i >= position:
                yield ex
    rows = read_jsonl(dataset_file(source.path, settings), source.prompt_key, source.answer_key)
    i = 0
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for j in order:
            if i >= position:
                yield rows[j]
            i += 1


EVAL_SEED_OFFSET = 1_000_003  # the evaluation stream of a builtin dataset: another seed than training's


def evaluation_examples(source: DatasetSource, prompts: int, seed: int, settings: Settings = DEFAULTS
                        ) -> list[Example]:
    """The evaluation set: a JSONL file's first ``prompts`` rows in file order, or a builtin
    dataset's first ``prompts`` examples under another seed than the training stream's."""
    if source.path.startswith("builtin:"):
        return list(itertools.islice(examples(source, seed + EVAL_SEED_OFFSET), prompts))
    return read_jsonl(dataset_file(source.path, settings), source.prompt_key, source.answer_key)[:prompts]
