"""What every benchmark ends with: its result written under ``benchmarks/results/`` and printed as the
last stdout line (one JSON object; progress goes to stderr). Imported by the scripts beside it
(``python benchmarks/NAME.py`` puts this directory on the path)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def add_out(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``: where the result goes (default ``benchmarks/results/<name>.json``)."""
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="the result's JSON file")


def report(result: dict[str, Any], out: Path | None) -> None:
    """``result`` into ``out`` (indented, when given) and as the last stdout line."""
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
