"""Faults during a local run, and what they cost: is every prompt trained exactly once, does a
replica fault stay away from the trainer, does the run still learn?

``kuberl run examples/cpu-tiny.yaml`` with 2 inference replicas and 2 trainer ranks (FSDP2, p2p
weight sync, a checkpoint every 5 steps). Once training runs, a seeded schedule injects ``--faults``
faults, one every few seconds, cycling through the kinds:

- ``replica-kill``: SIGKILL a replica (local mode replaces it, as a kubelet would);
- ``replica-hang``: SIGSTOP a replica for 12–20 s, then SIGCONT (longer than the health probe's
  10 s timeout: it leaves rotation, and comes back needing the current weights);
- ``trainer-kill``: SIGKILL one trainer rank (the gang restarts from its newest checkpoint).

Each fault waits until the trainer has trained past the step where the previous one found it, so every
fault hits a run that is training.

Then the run trains to its last step. Read back: the prompt audit (``prompts.jsonl``: the prompts
of every trained step, one line per step as trained; a restarted gang writes the steps after its
checkpoint again, and the last line of a step is the one the final weights descend from) and the
summary's prompt ledger. Reported: prompts trained twice (in two surviving steps), prompts skipped
(handed out, never trained, not pending), steps lost per trainer fault (the step at the kill − the
checkpoint resumed from), the stall a replica fault causes (seconds from the fault to the next
trained step, in steps of the run's median step time), gang restarts not caused by a trainer kill,
and the reward curve.

    python benchmarks/chaos.py [--faults 30] [--seed 0] [--steps 800] [--workdir DIR]

Progress goes to stderr; the last stdout line is the JSON result (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("replica-kill", "replica-hang", "trainer-kill")
STEP_LINE = re.compile(r"^(\S+ \S+) trainer INFO step (\d+)/\d+ ", re.MULTILINE)
RESUMED_LINE = re.compile(r"resumed from the checkpoint of step (\d+)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Fault:
    kind: str
    after_seconds: float  # after the previous fault
    hang_seconds: float = 0.0


def schedule(seed: int, count: int) -> list[Fault]:
    """``count`` faults cycling through ``KINDS``, a seeded 3–8 s apart (hangs 12–20 s)."""
    rng = random.Random(seed)
    return [Fault(KINDS[i % len(KINDS)], rng.uniform(3, 8), rng.uniform(12, 20) if KINDS[i % len(KINDS)]
                  == "replica-hang" else 0.0) for i in range(count)]  # fmt: skip


def lineage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The audit's records the final weights descend from: the last record of each step, by step."""
    last = {int(record["step"]): record for record in records}
    return [last[step] for step in sorted(last)]


def audit(records: list[dict[str, Any]], ledger: dict[str, int]) -> dict[str, int]:
    """Exactly-once accounting over the surviving lineage. ``ledger``: the summary's prompt ledger
    (``cursor``: prompts handed out so far; ``pending``: how many of them are not trained yet).
    Skipped = handed out − trained − pending; trained twice = in two surviving steps."""
    surviving = lineage(records)
    trained = [int(p) for record in surviving for p in record["prompts"]]
    once = {p for p in trained if p < ledger["cursor"]}
    return {"steps_audited": len(surviving), "prompts_trained": len(once),
            "prompts_trained_twice": len(trained) - len(set(trained)),
            "prompts_beyond_the_cursor": len(set(trained) - once),
            "prompts_skipped": ledger["cursor"] - len(once) - ledger["pending"],
            "prompts_skipped_by_the_ledger": ledger["skipped"], "prompts_pending": ledger["pending"]}


def step_times(trainer_log: str) -> list[tuple[float, int]]:
    """(wall-clock time, step) of every trained step in rank 0's log, in order."""
    return [(datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(s))
            for t, s in STEP_LINE.findall(trainer_log)]  # fmt: skip


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes(work: Path, module: str) -> list[int]:
    """Pids of this run's ``python -m <module>`` processes."""
    config = str(work / "experiment.yaml")
    return sorted(int(p.name) for p in Path("/proc").glob("[0-9]*")
                  if f"-m {module} " in _cmdline(int(p.name)) and config in _cmdline(int(p.name)))  # fmt: skip


def last_step(work: Path) -> int:
    text = (work / "trainer-0.log").read_text(errors="replace") if (work / "trainer-0.log").exists() else ""
    times = step_times(text)
    return times[-1][1] if times else 0


def wait_for_training(work: Path, proc: subprocess.Popen[bytes], after_step: int = 0, timeout: float = 600) -> None:
    """Until rank 0 logs a step past ``after_step`` (or the run ends)."""
    deadline = time.monotonic() + timeout
    while last_step(work) <= after_step and proc.poll() is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no trained step past {after_step} within {timeout:.0f} s")
        time.sleep(0.2)


def inject(fault: Fault, work: Path, rng: random.Random) -> dict[str, Any]:
    """Apply one fault now; returns what was done (kind, wall time, pid, the step then)."""
    module = "kuberl.trainer" if fault.kind == "trainer-kill" else "kuberl.inference"
    pid = rng.choice(processes(work, module))
    event = {"kind": fault.kind, "time": time.time(), "pid": pid, "step": last_step(work)}
    if fault.kind == "replica-hang":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(fault.hang_seconds)
        os.kill(pid, signal.SIGCONT)
        event["hang_seconds"] = round(fault.hang_seconds, 1)
    else:
        os.kill(pid, signal.SIGKILL)
    log(f"  {fault.kind} pid {pid} at step {event['step']}")
    return event


def costs(events: list[dict[str, Any]], trainer_log: str) -> dict[str, Any]:
    """Per fault kind: steps lost (trainer kills) and stall (replica faults) from rank 0's log."""
    steps = step_times(trainer_log)
    median_step = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1)
    resumed = [int(s) for s in RESUMED_LINE.findall(trainer_log)]
    kills = [e for e in events if e["kind"] == "trainer-kill"]
    lost = [e["step"] - r for e, r in zip(kills, resumed, strict=False)]
    stalls = []
    for e in (e for e in events if e["kind"] != "trainer-kill"):
        next_step = next((t for t, _ in steps if t > e["time"]), None)
        if next_step is not None:
            stalls.append((next_step - e["time"]) / median_step)
    return {"median_step_seconds": round(median_step, 3), "steps_lost_per_trainer_fault": lost,
            "max_stall_steps_per_replica_fault": round(max(stalls), 2) if stalls else None,
            "mean_stall_steps_per_replica_fault": round(statistics.fmean(stalls), 2) if stalls else None}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "kuberl_cli", "run", str(ROOT / "examples/cpu-tiny.yaml"), "-q",
               "--max-steps", str(args.steps), "--workdir", str(work), "--summary", str(work / "run-summary.json"),
               "--set", "inference.replicas=2", "--set", "trainer.acceleratorsPerNode=2",
               "--set", "checkpoint.everySteps=5", "--set", "trainer.backoffLimit=1000"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_training(work, proc)
    rng, events = random.Random(args.seed), []
    for fault in schedule(args.seed, args.faults):
        time.sleep(fault.after_seconds)
        if proc.poll() is not None:
            break
        # every fault hits a training run: the gang is past where the previous fault found it (after a
        # trainer kill: restarted and caught up), so a replica fault's stall is its own
        wait_for_training(work, proc, after_step=max([e["step"] for e in events] + [0]))
        if proc.poll() is not None:
            log(f"  the run ended after {len(events)} faults: give it more --steps")
            break
        events.append(inject(fault, work, rng))
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise SystemExit(f"the run failed:\n{stderr[-3000:]}")
    summary = json.loads((work / "run-summary.json").read_text())  # the trainer's summary + kuberl run's restarts
    records = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines() if line]
    curve = [r["reward"] for r in lineage(records)]  # the summary's rewards cover the last gang's steps only
    trainer_kills = sum(e["kind"] == "trainer-kill" for e in events)
    trainer_log = (work / "trainer-0.log").read_text(errors="replace")
    return {
        "faults": len(events), **{k: sum(e["kind"] == k for e in events) for k in KINDS},
        **audit(records, summary["prompts"]), **costs(events, trainer_log),
        "trainer_restarts": summary["restarts"]["trainer"],
        "trainer_restarts_from_replica_faults": summary["restarts"]["trainer"] - trainer_kills,
        "replica_restarts": summary["restarts"]["inference"],
        "reward_first10": round(statistics.fmean(curve[:10]), 3),
        "reward_last10": round(statistics.fmean(curve[-10:]), 3),
        "reward_gain": round(statistics.fmean(curve[-10:]) - statistics.fmean(curve[:10]), 3),
        "reward_curve_every_10": [round(statistics.fmean(curve[i:i + 10]), 3) for i in range(0, len(curve), 10)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/chaos.json")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run's logs here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kuberl-chaos-") as tmp:
        work = args.workdir or Path(tmp) / "run"
        log(f"kuberl run with {args.faults} faults (seed {args.seed}), {args.steps} steps; work dir {work}")
        result = run(args, work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
