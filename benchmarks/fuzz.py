"""Fuzz every door hostile input comes through; count the tracebacks (the target is 0).

Targets and their contract (anything else escaping is a traceback):

- ``manifest``: mutated example manifests as YAML text → ``kuberl validate``'s ``check_file`` (never
  raises: one line per problem), and for the valid ones the operator's builders (``render_resource``);
- ``yaml``: mutated manifest *text* (cut, spliced, bytes flipped, anchors multiplied) → ``check_file``;
- ``generate``: mutated ``/generate`` bodies → ``parse_generate`` (ValueError naming the field);
- ``progress``: arbitrary JSON replies → the operator's ``progress_status`` (never raises).

    python benchmarks/fuzz.py --cases 10000 [--seed 0]

The last line is JSON: cases, tracebacks, seconds and the count per target.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
HOSTILE: list[Any] = [
    None, True, -1, 0, 2**63, -(2**63) - 1, 10**40, 1e308, float("inf"), float("nan"), -0.0, "", " ", "0",
    "x" * 100_000, "\u202e\u0000\U0001f600é", "${HOME}", "../../etc/passwd", "s3://", "file:///", "-1", "1e9",
    [], {}, [[[[[]]]]], {"a": {"b": {"c": {}}}}, ["a"] * 1000, {"k" * 300: "v"}, "1" * 5000,
]


def hostile(rng: random.Random) -> Any:
    """A fresh copy of one HOSTILE value (never the shared one: a later edit must not change it)."""
    return copy.deepcopy(rng.choice(HOSTILE))


def deep(depth: int) -> Any:
    node: Any = 0
    for _ in range(depth):
        node = [node]
    return node


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``node`` (dict keys and list indexes), 20 levels deep at most."""
    out = [prefix]
    if len(prefix) >= 20:
        return out
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += paths(value, (*prefix, i))
    return out


def mutate(doc: Any, rng: random.Random) -> Any:
    """One to three edits at random places: replace, delete, add a key, nest deeply, change type."""
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths(doc))
        if not path:
            return rng.choice([hostile(rng), deep(rng.randint(50, 3000))])
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key, op = path[-1], rng.random()
        if op < 0.55:
            parent[key] = hostile(rng)
        elif op < 0.7:
            del parent[key]
        elif op < 0.8:
            parent[key] = deep(rng.randint(50, 3000))
        elif op < 0.9 and isinstance(parent, dict):
            parent[rng.choice(["extra", "x-kubernetes", "spec", "$ref", "__class__"])] = hostile(rng)
        else:
            value = parent[key]
            parent[key] = [value] if isinstance(value, str) else (type(value).__name__ if isinstance(
                value, list | dict) else str(value))
    return doc


def to_yaml(doc: Any) -> str:
    try:
        return yaml.safe_dump(doc, sort_keys=False)
    except RecursionError:  # too deep for the dumper: the same depth as flow-style text
        return "spec: " + "[" * 5000 + "]" * 5000


def mutate_text(text: str, rng: random.Random) -> str:
    op = rng.random()
    if op < 0.2:
        return text[: rng.randint(0, len(text))]
    if op < 0.4:
        i = rng.randint(0, len(text))
        return text[:i] + rng.choice(["\t", ": :", "- [", "{", "&a", "*a", "!!python/object:os.system ", "\x00",
                                      "%YAML 9.9\n", "---\n", "é"]) + text[i:]
    if op < 0.55:
        lines = text.splitlines(keepends=True)
        rng.shuffle(lines)
        return "".join(lines)
    if op < 0.7:
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 8)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return data.decode(errors="replace")
    if op < 0.85:  # "billion laughs": aliases that expand exponentially
        levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, rng.randint(4, 10))]
        return "\n".join(levels) + "\n" + text
    return text + "\n---\n" + text.replace("kind: RLExperiment", f"kind: {rng.choice(['Pod', '', '[]', 'null'])}")


def check_manifest(text: str, tmp: Path) -> None:
    from kuberl_cli.main import check_file
    from kuberl_operator.render import render_resource

    path = tmp / "case.yaml"
    path.write_text(text, errors="replace")
    objects, errors = check_file(path)
    assert all(isinstance(e, str) and "\n" not in e for e in errors), "errors must be one line each"
    for obj in objects:
        render_resource(obj)


def check_generate(body: Any) -> None:
    from kuberl.inference.server import parse_generate

    try:
        parse_generate(body, vocab_size=64, tokenizer=None)
    except ValueError as err:
        assert str(err) and "\n" not in str(err)


def check_progress(payload: Any) -> None:
    from kuberl_operator.progress import progress_status

    progress_status(payload)


def run(cases: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    seeds = [d for p in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
             if isinstance(d, dict)]
    texts = [to_yaml(d) for d in seeds]
    body = {"input_ids": [1, 2, 3], "n": 2, "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9}
    counts: Counter[str] = Counter()
    failures: list[str] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        targets: list[tuple[str, Callable[[], None]]] = [
            ("manifest", lambda: check_manifest(to_yaml(mutate(rng.choice(seeds), rng)), Path(tmp))),
            ("yaml", lambda: check_manifest(mutate_text(rng.choice(texts), rng), Path(tmp))),
            ("generate", lambda: check_generate(mutate(body, rng))),
            ("progress", lambda: check_progress(mutate({"step": 3, "reward": 0.5, "last_checkpoint": "s3://b/"},
                                                       rng))),
        ]
        for case in range(cases):
            name, check = targets[case % len(targets)]
            counts[name] += 1
            try:
                check()
            except Exception:  # the point: anything escaping is counted, and the first ones shown
                failures.append(f"{name} case {case}: {traceback.format_exc(limit=3)}")
    for text in failures[:5]:
        print(text, file=sys.stderr)
    return {"cases": cases, "tracebacks": len(failures), "seconds": round(time.perf_counter() - started, 1),
            "per_target": dict(counts), "seed": seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(run(args.cases, args.seed)))


if __name__ == "__main__":
    main()
