"""Is the main example stable? ``kuberl run examples/cpu-tiny.yaml`` (or ``--example``) under several seeds.

Per seed, and over all seeds: first-10 and last-10 training reward (mean over steps), peak and
final held-out evaluation reward, the policy's token entropy at the start and the end, RL wall
seconds, and the worst drawdowns after the learning-rate warm-up (``worst_drawdown_train10``: the largest
fall of the 10-step training-reward mean below its running best; ``worst_drawdown_eval``: of the held-out
reward below its best evaluation so far). A run that ends where it peaked has ``eval_final ≥ eval_peak − 0.05``.
A 10-step window of the training reward is noisy (16 prompts a step), so each seed also gets the drawdown its
own noise would make (``drawdown_noise_train10``: median and 90th percentile over simulated runs of its
smoothed curve plus its residual noise), and ``drawdowns_beyond_noise`` lists the seeds whose drawdown exceeds
that 90th percentile: a fall the noise does not explain.
Whether the numbers mean what they say: each evaluation's version span (``eval_version_span_max``: 1 when one
policy wrote each), how many steps after it was due it was recorded (``eval_late_steps_max``) and those skipped;
whether the trust region acted (``clip_active_share``: the share of steps on which the PPO clip clipped any
token; ``clip_ratio_mean``), how far the policy moved from its samples (``k3_kl_max``: the largest
``mismatch/k3_kl`` of a step) and how far each step moved it (``update_kl_max`` / ``_median``: KL(π_new ‖ π_old)
of a step; ``update_size_max`` / ``_median``: ‖Δθ‖ / ‖θ‖; ``kuberl.policy.update_size``).

    python benchmarks/example_seeds.py [--example examples/cpu-tiny.yaml] [--seeds 0 1 2 3 4] [--set KEY=VALUE]...
                                       [--max-steps N] [--keep DIR]

Runs one seed at a time (each run uses both cores: one replica, one trainer rank). Progress goes
to stderr; the last stdout line is the JSON result:
``{"seeds": [{"seed", "reward_first10_mean", "reward_last10_mean", "eval_peak", "eval_final",
"rl_seconds", "weight_update_fraction", ...}, ...], "all": {...}, "example", "settings": [...]}``
(``weight_update_fraction``: one weight update's bytes ÷ the whole policy's: 1.0 unless LoRA).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kuberl.local import load_experiment

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"
STABLE_MARGIN = 0.05  # eval_final ≥ eval_peak − this: the run ends where it peaked
DRAWDOWN_WINDOW = 10  # steps per training-reward mean in worst_drawdown_train10
TREND_HALF_WIDTH = 20  # the smoothed curve a run's noise is measured around: a centred 41-step mean
NOISE_RUNS = 200  # simulated runs per noise floor


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_seed(seed: int, settings: list[str], max_steps: int | None, workdir: Path, example: Path = EXAMPLE
             ) -> dict[str, Any]:
    """One ``kuberl run`` of the example; its summary reduced to the numbers this benchmark reports."""
    summary_path = workdir / "summary.json"
    command = [sys.executable, "-m", "kuberl_cli", "run", str(example), "-q", "--workdir", str(workdir),
               "--summary", str(summary_path), "--set", f"seed={seed}"]
    for setting in settings:
        command += ["--set", setting]
    if max_steps is not None:
        command += ["--max-steps", str(max_steps)]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: kuberl run exited {done.returncode}:\n{done.stderr[-3000:]}")
    warmup = load_experiment(example, settings).spec.algorithm.warmup_steps
    return seed_numbers(seed, json.loads(summary_path.read_text()), warmup)


def worst_drawdown(values: list[float]) -> float:
    """The largest fall of ``values`` below their running best: max over i of max(values[:i + 1]) − values[i]
    (0 when they never fall)."""
    best, worst = float("-inf"), 0.0
    for value in values:
        best = max(best, value)
        worst = max(worst, best - value)
    return worst


def smoothed(values: list[float], half: int = TREND_HALF_WIDTH) -> list[float]:
    """Each value's centred moving mean over ±``half`` steps (fewer at the ends)."""
    return [statistics.fmean(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def drawdown_noise_floor(values: list[float], window: int = DRAWDOWN_WINDOW, runs: int = NOISE_RUNS,
                         seed: int = 0) -> tuple[float, float]:
    """(median, 90th percentile) of the worst drawdown of ``window``-step means that a run with this
    curve would show from sampling noise alone: its smoothed curve (:func:`smoothed`) plus independent
    Gaussian noise of the residuals' standard deviation, ``runs`` times. A measured drawdown inside
    the 90th percentile is what the batch's noise makes, not a collapse."""
    if len(values) < 2 * TREND_HALF_WIDTH + window:
        return 0.0, 0.0
    trend = smoothed(values)
    inner = range(TREND_HALF_WIDTH, len(values) - TREND_HALF_WIDTH)
    sigma = statistics.pstdev([values[i] - trend[i] for i in inner])
    rng = random.Random(seed)
    floors = sorted(worst_drawdown(_windows([t + rng.gauss(0.0, sigma) for t in trend], window))
                    for _ in range(runs))
    return floors[runs // 2], floors[int(runs * 0.9)]


def seed_numbers(seed: int, summary: dict[str, Any], warmup: int = 0) -> dict[str, Any]:
    """The per-seed record: rewards, evaluation peak/final, entropy start/end, RL wall seconds, and the worst
    drawdowns after the learning-rate warm-up (``warmup`` steps): of the training reward's 10-step mean
    (windows starting at step ``warmup`` or later) and of the held-out reward (evaluations after step
    ``warmup``) — a run that collapses mid-way and recovers ends well but shows here."""
    evals = [e["reward"] for e in summary.get("eval") or []]
    entropies = summary.get("entropies") or []
    rewards = summary.get("rewards") or []
    late_evals = [e["reward"] for e in summary.get("eval") or [] if e["step"] > warmup]
    return {
        "seed": seed,
        "reward_first10_mean": _round(summary["reward_first10_mean"]),
        "reward_last10_mean": _round(summary["reward_last10_mean"]),
        "reward_peak10_mean": _round(max(_windows(summary.get("rewards") or [], 10), default=None)),
        "eval_steps": [e["step"] for e in summary.get("eval") or []],
        "eval_first": _round(evals[0] if evals else None),
        "eval_peak": _round(max(evals, default=None)),
        "eval_final": _round(evals[-1] if evals else None),
        "entropy_first10_mean": _round(summary.get("entropy_first10_mean")),
        "entropy_last10_mean": _round(summary.get("entropy_last10_mean")),
        "entropy_min": _round(min(entropies, default=None)),
        "rl_seconds": _round(summary["wall_seconds"], 1),
        "weight_update_fraction": summary.get("weight_update_fraction"),
        "worst_drawdown_train10": _round(worst_drawdown(_windows(rewards[warmup:], DRAWDOWN_WINDOW))),
        "drawdown_noise_train10": [_round(x) for x in drawdown_noise_floor(rewards[warmup:])],  # median, p90
        "worst_drawdown_eval": _round(worst_drawdown(late_evals)),
        "eval_version_span_max": max((e.get("version_span", 1) for e in summary.get("eval") or []), default=None),
        "eval_late_steps_max": max((e["reported_after_step"] - e["step"] for e in summary.get("eval") or []
                                    if "reported_after_step" in e), default=None),
        "eval_skipped": summary.get("eval_skipped"),
        "clip_active_share": summary.get("clip_active_share"),
        "clip_ratio_mean": summary.get("clip_ratio_mean"),
        "k3_kl_max": summary.get("k3_kl_max"),
        **{key: summary.get(key) for key in ("update_kl_max", "update_kl_median", "update_size_max",
                                              "update_size_median")},
    }


def _windows(values: list[float], width: int) -> list[float]:
    return [statistics.fmean(values[i:i + width]) for i in range(0, max(len(values) - width + 1, 0))]


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def overall(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds, the worst seed's numbers, and whether every seed ended where it peaked."""
    def numbers(key: str) -> list[float]:
        return [s[key] for s in seeds if s[key] is not None]

    return {
        "reward_first10_mean": _round(statistics.fmean(numbers("reward_first10_mean"))),
        "reward_last10_mean": _round(statistics.fmean(numbers("reward_last10_mean"))),
        "reward_last10_min": _round(min(numbers("reward_last10_mean"))),
        "eval_peak_mean": _round(statistics.fmean(numbers("eval_peak"))) if numbers("eval_peak") else None,
        "eval_final_mean": _round(statistics.fmean(numbers("eval_final"))) if numbers("eval_final") else None,
        "worst_eval_drop": _round(max((s["eval_peak"] - s["eval_final"] for s in seeds
                                       if s["eval_peak"] is not None), default=0.0)),
        "ends_where_it_peaks": all(s["eval_final"] is None or s["eval_final"] >= s["eval_peak"] - STABLE_MARGIN
                                   for s in seeds),
        "rl_seconds_mean": _round(statistics.fmean(numbers("rl_seconds")), 1),
        "worst_drawdown_train10": _round(max(numbers("worst_drawdown_train10"), default=0.0)),
        "drawdowns_beyond_noise": [s["seed"] for s in seeds if s.get("drawdown_noise_train10") and
                                   s["worst_drawdown_train10"] > s["drawdown_noise_train10"][1]],
        "worst_drawdown_eval": _round(max(numbers("worst_drawdown_eval"), default=0.0)),
        "clip_active_share_min": _round(min(numbers("clip_active_share"), default=None), 4)
        if numbers("clip_active_share") else None,
        "k3_kl_max": _round(max(numbers("k3_kl_max"), default=0.0), 4),
        "update_kl_max": max(numbers("update_kl_max"), default=None),
        "update_size_max": max(numbers("update_size_max"), default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the RLExperiment file (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to kuberl run --set (e.g. algorithm.learningRate=1e-4)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--keep", metavar="DIR", help="keep each seed's work dir (logs, TensorBoard) as DIR/seed-N")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        if args.keep:
            workdir = Path(args.keep) / f"seed-{seed}"
            workdir.mkdir(parents=True, exist_ok=True)
            result = run_seed(seed, args.settings, args.max_steps, workdir, args.example)
        else:
            with tempfile.TemporaryDirectory(prefix=f"kuberl-seed{seed}-") as tmp:
                result = run_seed(seed, args.settings, args.max_steps, Path(tmp), args.example)
        log(f"seed {seed}: reward first10 {result['reward_first10_mean']} last10 {result['reward_last10_mean']} "
            f"(peak10 {result['reward_peak10_mean']}), eval peak {result['eval_peak']} final {result['eval_final']}, "
            f"entropy {result['entropy_first10_mean']} → {result['entropy_last10_mean']}, drawdown train10 "
            f"{result['worst_drawdown_train10']} eval {result['worst_drawdown_eval']}, RL {result['rl_seconds']} s")
        results.append(result)
    summary = overall(results)
    log(f"all: reward last10 mean {summary['reward_last10_mean']} (min {summary['reward_last10_min']}), "
        f"eval peak {summary['eval_peak_mean']} final {summary['eval_final_mean']}, worst drop "
        f"{summary['worst_eval_drop']}, ends where it peaks: {summary['ends_where_it_peaks']}")
    example = args.example.resolve()
    shown = str(example.relative_to(ROOT)) if example.is_relative_to(ROOT) else str(example)
    print(json.dumps({"seeds": results, "all": summary, "example": shown, "settings": args.settings}))


if __name__ == "__main__":
    main()
