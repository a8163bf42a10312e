"""Faults during a local run, and what they cost: is every prompt trained exactly once, does a
replica fault stay away from the trainer, does the run still learn?

``kuberl run examples/cpu-tiny.yaml`` with 2 inference replicas and 2 trainer ranks (FSDP2, p2p
weight sync, a checkpoint every 5 steps). Once training runs, a seeded schedule injects ``--faults``
faults, one every few seconds, cycling through the kinds:

- ``replica-kill``: SIGKILL a replica (local mode replaces it, as a kubelet would);
- ``replica-hang``: SIGSTOP a replica for 12–20 s, then SIGCONT (it leaves rotation — at the next
  weight push, as a straggler, or after the health probe's timeout — and comes back needing the
  current weights);
- ``replica-500``: the replica answers every ``/generate`` with HTTP 500 for 12–20 s while ``/health``
  stays 200 (its fault door, ``kuberl.inference.faults``, which this script opens with
  ``KUBERL_FAULT_INJECTION=signals``);
- ``trainer-kill``: SIGKILL one trainer rank (the gang restarts from its newest checkpoint);
- ``rollout-kill``: SIGKILL rank 0's rollout process (``kuberl.trainer.rollout_process``: the
  trainer fails at its next call to it, and the gang restarts from its newest checkpoint).

Each fault waits until every replica is back in the exchange group since the previous fault ended and
the trainer has trained past the step where that fault found it (after a trainer or rollout kill: the
restarted gang has, not the dying one's last line), so every fault hits a whole run that is training
and a replica fault's stall is its own, not a gang restart's (two faults at once — a replica hung
while the other restarts — leave no replica to generate, which no containment can hide).

Then the run trains to its last step. Read back: the prompt audit (``prompts.jsonl``: the prompts
of every trained step, one line per step as trained; a restarted gang writes the steps after its
checkpoint again, and the last line of a step is the one the final weights descend from) and the
summary's prompt ledger. Reported: prompts trained twice (in two surviving steps), prompts skipped
(handed out, never trained, not pending), steps lost per trainer fault (the step at the kill − the
checkpoint resumed from), the stall a replica fault causes (the longest time between two trained
steps that ends after the fault began and before the next one, and begins by ``STALL_WINDOW`` s after
it ended; less the run's median step, in median steps: 0 when the trainer never noticed), gang restarts not caused by a
trainer kill, and the reward curve.

    python benchmarks/chaos.py [--faults 40] [--seed 0] [--steps 3000] [--kinds KIND …] [--workdir DIR]

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

from common import add_out, report

from kuberl.api.contract import ENV_FAULT_INJECTION

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("replica-kill", "replica-hang", "replica-500", "trainer-kill", "rollout-kill")
GANG_FAULTS = ("trainer-kill", "rollout-kill")  # the gang restarts from its checkpoint: steps are lost, not stalled
LASTING = ("replica-hang", "replica-500")  # faults that last a while, then end
DOOR_READY_SECONDS = 30.0  # a replica this old has its fault door (SIGUSR1 before it would end the process)
STALL_WINDOW = 10.0  # seconds after a replica fault ends (and before the next begins) in which a gap counts
STEP_LINE = re.compile(r"^(\S+ \S+) trainer INFO step (\d+)/\d+ ", re.MULTILINE)
GROUP_LINE = re.compile(r"^(\S+ \S+) trainer INFO p2p weight exchange \(group \d+\): \d+ trainer ranks → (\d+) "
                        r"replicas", re.MULTILINE)
REPLICAS = 2
RESUMED_LINE = re.compile(r"resumed from the checkpoint of step (\d+)")
GANG_START_LINE = re.compile(r"trainer INFO rollout process \d+ started")  # every start of rank 0, resumed or not


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Fault:
    kind: str
    after_seconds: float  # after the previous fault
    seconds: float = 0.0  # how long a lasting fault lasts


def schedule(seed: int, count: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """``count`` faults cycling through ``kinds``, a seeded 1–4 s apart (hangs and 500s last 12–20 s)."""
    rng = random.Random(seed)
    return [Fault(kinds[i % len(kinds)], rng.uniform(1, 4), rng.uniform(12, 20) if kinds[i % len(kinds)]
                  in LASTING else 0.0) for i in range(count)]  # fmt: skip


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


def rank0_log(work: Path) -> str:
    return (work / "trainer-0.log").read_text(errors="replace") if (work / "trainer-0.log").exists() else ""


def trained_past(log_text: str, step: int, since: int, restarted: bool) -> bool:
    """Rank 0's log shows a step past ``step`` written after its first ``since`` characters — with
    ``restarted`` (after a gang fault), after the restarted gang's first line there: a dying gang
    still logs the step it was on, and that line must not count as training again."""
    text = log_text[since:]
    if restarted:
        started = GANG_START_LINE.search(text)
        if started is None:
            return False
        text = text[started.end():]
    return any(s > step for _, s in step_times(text))


def whole_pool_since(work: Path, since: float, replicas: int) -> bool:
    """Rank 0 formed a p2p exchange group with all ``replicas`` after wall time ``since``: every replica
    is back in rotation with the newest weights."""
    text = rank0_log(work)
    return any(datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp() > since and int(n) == replicas
               for t, n in GROUP_LINE.findall(text))  # fmt: skip


def wait_for_whole_pool(work: Path, proc: subprocess.Popen[bytes], since: float, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not whole_pool_since(work, since, REPLICAS) and proc.poll() is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the pool was not whole again within {timeout:.0f} s")
        time.sleep(0.2)


def wait_for_training(work: Path, proc: subprocess.Popen[bytes], previous: dict[str, Any] | None = None,
                      timeout: float = 600) -> None:
    """Until rank 0 logs a step past the one where the ``previous`` fault found it, after that fault
    (``trained_past``; without one: any step), or the run ends."""
    step, since = (previous["step"], previous["log_offset"]) if previous else (0, 0)
    restarted = previous is not None and previous["kind"] in GANG_FAULTS
    deadline = time.monotonic() + timeout
    while not trained_past(rank0_log(work), step, since, restarted) and proc.poll() is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no trained step past {step} within {timeout:.0f} s")
        time.sleep(0.2)


def rollout_processes(work: Path) -> list[int]:
    """Pids of this run's rollout process (a child of trainer rank 0; its command line names no config)."""
    trainers = set(processes(work, "kuberl.trainer"))
    return sorted(int(p.name) for p in Path("/proc").glob("[0-9]*")
                  if "-m kuberl.trainer.rollout_process " in _cmdline(int(p.name)) and _parent(int(p.name)) in trainers)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def age_seconds(pid: int) -> float:
    """How long process ``pid`` has run (its start time in /proc, in clock ticks since boot)."""
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def inject(fault: Fault, work: Path, rng: random.Random) -> dict[str, Any]:
    """Apply one fault now; returns what was done (kind, wall time, pid, the step then)."""
    module = "kuberl.trainer" if fault.kind == "trainer-kill" else "kuberl.inference"
    candidates = rollout_processes(work) if fault.kind == "rollout-kill" else processes(work, module)
    if fault.kind == "replica-500":  # the door opens once the server is up: a replacement may still be starting
        while not (candidates := [p for p in processes(work, module) if age_seconds(p) > DOOR_READY_SECONDS]):
            time.sleep(0.5)
    pid = rng.choice(candidates)
    text = rank0_log(work)
    times = step_times(text)
    event = {"kind": fault.kind, "time": time.time(), "pid": pid, "step": times[-1][1] if times else 0,
             "log_offset": len(text)}
    if fault.kind in LASTING:  # a hang: SIGSTOP … SIGCONT; 500s: the replica's fault door (kuberl.inference.faults)
        begin, end = (signal.SIGSTOP, signal.SIGCONT) if fault.kind == "replica-hang" else (signal.SIGUSR1,
                                                                                             signal.SIGUSR2)
        os.kill(pid, begin)
        time.sleep(fault.seconds)
        os.kill(pid, end)
        event["fault_seconds"] = round(fault.seconds, 1)
    else:
        os.kill(pid, signal.SIGKILL)
    event["ended"] = time.time()
    log(f"  {fault.kind} pid {pid} at step {event['step']}")
    return event


def longest_gap(steps: list[tuple[float, int]], start: float, until: float, end_by: float) -> float:
    """The longest time between two consecutive trained steps that ends after ``start``, begins by
    ``until`` and ends by ``end_by`` (the next fault: a gap it causes is its own)."""
    times = [t for t, _ in steps]
    gaps = [b - a for a, b in itertools.pairwise(times) if start < b <= end_by and a <= until]
    return max(gaps, default=0.0)


def costs(events: list[dict[str, Any]], trainer_log: str) -> dict[str, Any]:
    """Per fault kind: steps lost (trainer kills) and stall (replica faults) from rank 0's log."""
    steps = step_times(trainer_log)
    median_step = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1)
    resumed = [int(s) for s in RESUMED_LINE.findall(trainer_log)]
    kills = [e for e in events if e["kind"] in GANG_FAULTS]
    lost = [e["step"] - r for e, r in zip(kills, resumed, strict=False)]
    stalls = [{"kind": e["kind"], "step": e["step"], "stall_steps": round(max(0.0, longest_gap(
        steps, e["time"], e["ended"] + STALL_WINDOW, after["time"] if after else float("inf"))
        - median_step) / median_step, 2)}
        for e, after in zip(events, [*events[1:], None], strict=True) if e["kind"] not in GANG_FAULTS]  # fmt: skip
    values = [s["stall_steps"] for s in stalls]
    quiet = baseline_stalls(steps, events[-1]["ended"] + 3 * STALL_WINDOW if events else 0.0, median_step)
    return {"median_step_seconds": round(median_step, 3), "steps_lost_per_trainer_fault": lost,
            "max_stall_steps_per_replica_fault": max(values, default=None),
            "mean_stall_steps_per_replica_fault": round(statistics.fmean(values), 2) if values else None,
            "stall_per_replica_fault": stalls,
            "fault_free_stall_steps_mean": round(statistics.fmean(quiet), 2) if quiet else None,
            "fault_free_stall_steps_max": round(max(quiet), 2) if quiet else None}


def baseline_stalls(steps: list[tuple[float, int]], after: float, median_step: float) -> list[float]:
    """The same measure on fault-free stretches (after wall time ``after``: the run's end, no faults): one
    window of a lasting fault plus ``STALL_WINDOW`` every 20 steps. What a run's own variation gives
    (checkpoint steps are longer), to read a fault's stall against."""
    quiet = [(t, s) for t, s in steps if t > after]
    return [max(0.0, longest_gap(quiet, quiet[i][0], quiet[i][0] + 16 + STALL_WINDOW, float("inf")) - median_step)
            / median_step for i in range(0, len(quiet) - 1, 20)]  # fmt: skip


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "kuberl_cli", "run", str(ROOT / "examples/cpu-tiny.yaml"), "-q",
               "--max-steps", str(args.steps), "--workdir", str(work), "--summary", str(work / "run-summary.json"),
               "--set", f"inference.replicas={REPLICAS}", "--set", "trainer.acceleratorsPerNode=2",
               "--set", "checkpoint.everySteps=5", "--set", "trainer.backoffLimit=1000"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, ENV_FAULT_INJECTION: "signals"})  # the replicas' door for 500s
    wait_for_training(work, proc)
    rng, events = random.Random(args.seed), []
    for fault in schedule(args.seed, args.faults, tuple(args.kinds)):
        time.sleep(fault.after_seconds)
        if proc.poll() is not None:
            break
        # every fault hits a whole, training run: every replica is back in the exchange group since the
        # previous fault ended, and the gang is past where that fault found it (after a gang fault:
        # restarted and caught up), so a fault's stall is its own
        wait_for_whole_pool(work, proc, since=events[-1]["ended"] if events else 0.0)
        wait_for_training(work, proc, events[-1] if events else None)
        if proc.poll() is not None:
            log(f"  the run ended after {len(events)} faults: give it more --steps")
            break
        try:
            events.append(inject(fault, work, rng))
        except ProcessLookupError:  # its target exited under it: the run ended (or the process was replaced)
            if proc.poll() is not None:
                log(f"  the run ended during fault {len(events) + 1}: give it more --steps")
                break
            raise
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise SystemExit(f"the run failed:\n{stderr[-3000:]}")
    summary = json.loads((work / "run-summary.json").read_text())  # the trainer's summary + kuberl run's restarts
    records = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines() if line]
    curve = [r["reward"] for r in lineage(records)]  # the summary's rewards cover the last gang's steps only
    trainer_kills = sum(e["kind"] in GANG_FAULTS for e in events)
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
        "events": events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="fault kinds to cycle through")
    add_out(parser, "chaos")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run's logs here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kuberl-chaos-") as tmp:
        work = args.workdir or Path(tmp) / "run"
        log(f"kuberl run with {args.faults} faults (seed {args.seed}), {args.steps} steps; work dir {work}")
        result = run(args, work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
