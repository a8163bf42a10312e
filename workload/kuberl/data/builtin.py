"""Datasets generated in code (``builtin:NAME``), no download: ``BUILTIN`` streams (seeded, endless)
and ``TABLES``, rows written to a Parquet file in the node-local cache at run time and then read like
any user's file (:mod:`.tables`): the file path, the chat-list prompts and nested columns included.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from .example import Example


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


CHAT_MATH_PHRASINGS = ("{a}+{b}=", "what is {a}+{b}?", "add {a} and {b}.")
CHAT_MATH_LONG = "please work out the sum of the two numbers {a} and {b}, then answer."  # one row in 8


def chat_math(rows: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    """Single-digit addition in verl's conventions: a chat-list ``prompt`` ([{role, content}]), the
    answer nested under ``reward_model.ground_truth``, and columns that travel to the reward
    (``data_source``, ``extra_info``). Every text is within the tiny models' alphabet."""
    rng = random.Random(seed)
    out = []
    for index in range(rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        phrasing = CHAT_MATH_PHRASINGS[index % 3] if index % 8 else CHAT_MATH_LONG
        out.append({"data_source": "kuberl/chat-math", "ability": "math",
                    "prompt": [{"role": "user", "content": phrasing.format(a=a, b=b)}],
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"index": index, "a": a, "b": b}})
    return out


TABLES = {"chat-math": chat_math}


def table_file(name: str, cache_dir: Path) -> Path:
    """The Parquet file of builtin table ``name`` under ``cache_dir`` (written once, atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = cache_dir / "builtin" / f"{name}.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{random.getrandbits(32):08x}.partial")
        pq.write_table(pa.Table.from_pylist(TABLES[name]()), partial)
        partial.replace(path)
    return path
