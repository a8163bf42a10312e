"""What kopf itself costs per watch event — the floor under the operator's CPU per experiment while
it used kopf's watches (until 2026-11-27; its own informers watch now: ``kuberl_operator.informer``).
Kept to compare against.

Runs a bare kopf operator (its own process: ``kopf run`` of a file with one no-op ``on.event``
handler for ConfigMaps, kopf's settings and the collector's tuning as the operator sets them)
against the emulated API server, creates ``--objects`` ConfigMaps and patches each once (two watch
events per object), and reports the operator's CPU milliseconds per event (utime + stime from
/proc, from the first create until every event was handled). Times the ``watch_events_per_experiment``
``operator_scale.py`` reports, it was kopf's share of an experiment.

    python benchmarks/kopf_floor.py --objects 5000

The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.operator_scale import cpu_ms, report  # noqa: E402
from tests.harness import emulated_cluster  # noqa: E402

HANDLERS = '''
import logging, kopf
from kuberl_operator.main import tune_garbage_collection

@kopf.on.startup()
async def configure(settings, **_):
    settings.posting.level = logging.WARNING  # as kuberl_operator.handlers.configure
    settings.queueing.idle_timeout = 0.5
    tune_garbage_collection()

@kopf.on.event("", "v1", "configmaps")
async def seen(event, **_):
    with open({count!r}, "a") as out:  # one byte per event: the benchmark counts them
        out.write(".")
'''


async def measure(objects: int, timeout: float) -> dict[str, float | int | None]:
    with tempfile.TemporaryDirectory() as tmp:
        count = Path(tmp) / "count"
        count.write_text("")
        handlers = Path(tmp) / "handlers.py"
        handlers.write_text(HANDLERS.format(count=str(count)))
        async with emulated_cluster(Path(tmp)) as cluster:
            operator = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "--standalone", "-n", "team-a", "--quiet", str(handlers)],
                env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await asyncio.sleep(5)  # started, listed, idle
                cpu0, start = cpu_ms(operator.pid), time.perf_counter()
                for i in range(objects):
                    await cluster.api.create("", "configmaps", "team-a",
                                             {"metadata": {"name": f"cm-{i:05d}"}, "data": {"a": "1"}})
                for i in range(objects):
                    await cluster.api.patch("", "configmaps", "team-a", f"cm-{i:05d}", {"data": {"b": "2"}})
                expected = 2 * objects
                deadline = start + timeout
                while len(count.read_text()) < expected and time.perf_counter() < deadline:
                    await asyncio.sleep(0.05)
                handled = len(count.read_text())
                used = cpu_ms(operator.pid) - cpu0
            finally:
                operator.terminate()
                operator.wait(30)
    return {"objects": objects, "events": handled, "seconds": round(time.perf_counter() - start, 2),
            "cpu_ms_per_event": round(used / max(handled, 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=5000)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    report(asyncio.run(measure(args.objects, args.timeout)))


if __name__ == "__main__":
    main()
