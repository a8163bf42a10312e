"""Reference curves: the main example's learning check compares its run with runs kept in the repo.

``tests/test_curves.py`` runs ``examples/cpu-tiny.yaml`` for :data:`STEPS` steps with :data:`SETTINGS`
and compares its curve — the training reward's mean over each :data:`WINDOW` steps, and each held-out
evaluation — with ``tests/reference/cpu_tiny.json``: the same command run again and again, two at a
time (as a loaded CI host runs it), each point's mean and its spread σ (sample standard deviation) over
those runs — what an asynchronous run's timing alone moves. A point passes inside mean ± max(K·σ, FLOOR),
σ never below the point's own sampling noise;
a change that moves the curve reads as a table of the points outside, with numbers — not a threshold
that a slow host trips. The file also keeps each point's spread over seeds (``seed_sigma``): how far
another seed's curve lies, for scale.

A variant (:data:`VARIANTS`: the same command with a few settings more, e.g. every replica split over two
processes) runs on other timing by construction — a two-process replica on the same cores generates
several times slower, so other policy versions generate each step's samples — and has its own file
(``cpu_tiny-VARIANT.json``), measured the same way. Regenerate (and commit) after a change meant to move
the curve, the variants too:

    .venv/bin/python -m tests.reference [--repeats 8] [--seeds 1 2 3 4]     # ≈ 15 s a run on 2 cores
    .venv/bin/python -m tests.reference --variant tensor-parallel-2 --seeds  # ≈ 70 s a run

(the last stdout line is the JSON written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"
REFERENCE = Path(__file__).resolve().parent / "reference" / "cpu_tiny.json"
VARIANTS: dict[str, tuple[str, ...]] = {
    "tensor-parallel-2": ("inference.tensorParallel=2", "inference.acceleratorsPerNode=1"),
}
STEPS = 120
EVERY = 60
SETTINGS = ("algorithm.learningRate=3e-4", f"evaluation.everySteps={EVERY}", "evaluation.samplesPerPrompt=16")
WINDOW = 20  # steps per training-reward point (at 16 samples a step, one window's mean has σ ≈ 0.03 from noise)
K = 4.0  # band half-width in the repeats' σ
FLOOR = 0.04  # and never narrower than this (a few runs estimate σ roughly)
# Samples behind each point: a training window (WINDOW steps × the example's 128 a step) and an evaluation
# (the example's 64 prompts × SETTINGS' 16 samples). A point's σ is never taken below its sampling noise
# √(p(1 − p)/n): eight repeats can put their σ under it by chance (eval@120's 0.0093 against 0.0155).
TRAIN_SAMPLES = WINDOW * 128
EVAL_SAMPLES = 64 * 16


def reference_file(variant: str | None = None) -> Path:
    """Where the reference of the example (``variant`` None) or of one of :data:`VARIANTS` is kept."""
    return REFERENCE if variant is None else REFERENCE.with_name(f"{REFERENCE.stem}-{variant}.json")


def load(variant: str | None = None) -> dict[str, Any]:
    return json.loads(reference_file(variant).read_text())


def command(workdir: Path, summary: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The ``kuberl run`` of the reference and of the test: the example, :data:`STEPS` steps, :data:`SETTINGS`."""
    sets = [arg for setting in (*SETTINGS, *extra) for arg in ("--set", setting)]
    return [sys.executable, "-m", "kuberl_cli", "run", str(EXAMPLE), "--max-steps", str(STEPS), *sets,
            "--workdir", str(workdir), "--summary", str(summary)]


def curve(summary: dict[str, Any]) -> dict[str, float]:
    """A run's points: ``train[a:b]`` (mean training reward over steps a..b−1) and ``eval@s``."""
    rewards = summary["rewards"]
    points = {f"train[{a}:{a + WINDOW}]": statistics.fmean(rewards[a:a + WINDOW])
              for a in range(0, len(rewards) - WINDOW + 1, WINDOW)}
    return points | {f"eval@{e['step']}": e["reward"] for e in summary.get("eval") or []}


@dataclass(frozen=True)
class Point:
    name: str
    got: float | None
    mean: float
    sigma: float

    @property
    def sampling_sigma(self) -> float:
        """√(p(1 − p)/n) at the reference mean p, n the point's samples."""
        n = EVAL_SAMPLES if self.name.startswith("eval@") else TRAIN_SAMPLES
        p = min(max(self.mean, 0.0), 1.0)
        return (p * (1 - p) / n) ** 0.5

    @property
    def half_width(self) -> float:
        return max(K * max(self.sigma, self.sampling_sigma), FLOOR)

    @property
    def inside(self) -> bool:
        return self.got is not None and abs(self.got - self.mean) <= self.half_width


def compare(points: dict[str, float], reference: dict[str, Any]) -> list[Point]:
    """Every reference point beside this run's value (None where the run has no such point)."""
    return [Point(name, points.get(name), ref["mean"], ref["sigma"]) for name, ref in reference["points"].items()]


def table(compared: list[Point]) -> str:
    """The comparison as text: one row a point, the ones outside marked."""
    rows = [f"{'point':<14} {'run':>7} {'reference':>9} {'band':>13} {'Δ/σ':>6}"]
    for p in compared:
        got = "-" if p.got is None else f"{p.got:.3f}"
        ratio = "-" if p.got is None or p.sigma == 0 else f"{(p.got - p.mean) / p.sigma:+.1f}"
        band = f"{p.mean - p.half_width:.3f}..{p.mean + p.half_width:.3f}"
        rows.append(f"{p.name:<14} {got:>7} {p.mean:>9.3f} {band:>13} {ratio:>6}{'' if p.inside else '  OUTSIDE'}")
    return "\n".join(rows)


def spread(curves: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Each point every curve has: its mean and sample σ over the curves, and the curves' values."""
    names = [n for n in curves[0] if all(n in c for c in curves)]
    return {n: {"mean": round(statistics.fmean(c[n] for c in curves), 4),
                "sigma": round(statistics.stdev(c[n] for c in curves), 4),
                "runs": [round(c[n], 4) for c in curves]} for n in names}


def run_curve(workdir: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """One run of :func:`command` started (its summary at ``workdir``.json)."""
    return subprocess.Popen(command(workdir, workdir.with_suffix(".json"), extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def curves_of(runs: list[tuple[str, ...]], at_once: int, tmp: Path) -> list[dict[str, float]]:
    """The curves of runs with these extra settings, ``at_once`` at a time."""
    curves: list[dict[str, float]] = []
    tmp.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(runs), at_once):
        batch = [(tmp / f"run{start + i}", extra) for i, extra in enumerate(runs[start:start + at_once])]
        started = [(work, run_curve(work, extra)) for work, extra in batch]
        for work, process in started:
            _, err = process.communicate()
            if process.returncode != 0:
                raise SystemExit(f"{process.args}: exited {process.returncode}:\n{err[-3000:]}")
            curves.append(curve(json.loads(work.with_suffix(".json").read_text())))
            print(f"{work.name}: {curves[-1]}", file=sys.stderr, flush=True)
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="runs of the test's own command")
    parser.add_argument("--at-once", type=int, default=2, help="runs side by side (a loaded host)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3, 4], help="other seeds, for scale")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="measure this variant of the command")
    parser.add_argument("--out", type=Path, help="default: the reference's (or the variant's) file")
    args = parser.parse_args()
    extra = VARIANTS[args.variant] if args.variant else ()
    with tempfile.TemporaryDirectory() as tmp:
        repeats = curves_of([extra] * args.repeats, args.at_once, Path(tmp))
        seeds = curves_of([(*extra, f"seed={seed}") for seed in args.seeds], args.at_once, Path(tmp) / "seeds") \
            if args.seeds else []
    points = spread(repeats)
    seed_sigma = {n: p["sigma"] for n, p in spread([repeats[0], *seeds]).items()} if seeds else {}
    reference = {"example": str(EXAMPLE.relative_to(ROOT)), "steps": STEPS, "settings": [*SETTINGS, *extra],
                 "window": WINDOW, "repeats": args.repeats, "at_once": args.at_once, "seeds": args.seeds,
                 "k": K, "floor": FLOOR, "points": points, "seed_sigma": seed_sigma}
    out = args.out or reference_file(args.variant)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reference, indent=1) + "\n")
    print(json.dumps(reference))


if __name__ == "__main__":
    main()
