"""What other tenants' workloads cost the operator: nothing, when its watches select only its own.

Runs the real operator (``kuberl operator``, its own process, watching every namespace as the chart's
default does) against the emulated API server, with ``--pods`` pods and as many ConfigMaps of
another team (no KubeRL label) in a namespace beside it: half exist when the operator starts (its
first lists), half are created while it runs, and every pod then changes status twice (Running,
Succeeded). Reports the operator's CPU milliseconds and peak RSS (VmHWM) while it starts and
while the neighbours come and change, and how many of their objects the API server sent it (in lists
and watch events; 0 with server-side label selectors, ``kuberl_operator.watches``).

    python benchmarks/operator_neighbours.py --pods 5000

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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.operator_scale import cpu_ms, peak_mib, report  # noqa: E402
from tests.harness import emulated_cluster  # noqa: E402
from tests.kube_emulator import KubeEmulator  # noqa: E402

NAMESPACE = "their-team"


async def neighbours(api: KubeEmulator, first: int, count: int) -> None:
    """``count`` of another team's pods and ConfigMaps, numbered from ``first``."""
    for i in range(first, first + count):
        labels = {"app": f"their-service-{i % 50}"}
        await api.create("", "pods", NAMESPACE, {"metadata": {"name": f"pod-{i:06d}", "labels": labels},
                                                 "spec": {"containers": [{"name": "main", "image": "theirs:1"}]}})
        await api.create("", "configmaps", NAMESPACE, {"metadata": {"name": f"cm-{i:06d}", "labels": labels},
                                                       "data": {"settings": "x" * 200}})


async def churn(api: KubeEmulator, count: int) -> None:
    """Every pod Running, then Succeeded: two status changes each."""
    for phase in ("Running", "Succeeded"):
        for i in range(count):
            await api.patch("", "pods", NAMESPACE, f"pod-{i:06d}", {"status": {"phase": phase}}, subresource="status")


async def measure(pods: int, settle: float) -> dict[str, Any]:
    out: dict[str, Any] = {"pods": pods, "configmaps": pods}
    with tempfile.TemporaryDirectory() as tmp:
        async with emulated_cluster(Path(tmp)) as cluster:
            api = cluster.api
            await api.create("", "namespaces", None, {"metadata": {"name": NAMESPACE}})
            await neighbours(api, 0, pods // 2)
            operator = subprocess.Popen([sys.executable, "-m", "kuberl_cli", "operator"],
                                        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                                             "KUBERL_PROGRESS_SECONDS": "3600"},
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await asyncio.sleep(settle)  # started and listed what there is
                out["startup_cpu_ms"] = round(cpu_ms(operator.pid), 1)
                out["peak_mib_after_start"] = peak_mib(operator.pid)
                cpu0, start = cpu_ms(operator.pid), time.perf_counter()
                await neighbours(api, pods // 2, pods - pods // 2)
                await churn(api, pods)
                await asyncio.sleep(settle)  # whatever was sent is handled
                out["their_changes_while_running"] = 2 * (pods - pods // 2) + 2 * pods  # creates, status changes
                out["neighbours_seconds"] = round(time.perf_counter() - start, 1)
                out["cpu_ms_while_neighbours_changed"] = round(cpu_ms(operator.pid) - cpu0, 1)
                out["peak_mib"] = peak_mib(operator.pid)
            finally:
                operator.terminate()
                operator.wait(30)
    out["their_objects_sent_to_operator"] = sum(n for (plural, name), n in api.delivered.items()
                                                if name.startswith(("pod-", "cm-")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5000, help="another team's pods (and as many ConfigMaps)")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds to let the operator catch up")
    args = parser.parse_args()
    report(asyncio.run(measure(args.pods, args.settle)))


if __name__ == "__main__":
    main()
