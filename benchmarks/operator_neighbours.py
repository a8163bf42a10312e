"""What other tenants' workloads cost the operator: nothing, when its watches select only its own.

Runs the real operator (``kuberl operator``, its own process, watching every namespace as the chart's
default does) against the emulated API server, with ``--pods`` pods and as many ConfigMaps of
another team (no KubeRL label) in a namespace beside it: half exist when the operator starts (its
first lists), half are created while it runs, and every pod then changes status twice (Running,
Succeeded). Reports the operator's CPU milliseconds and peak RSS (VmHWM) while it starts and
while the neighbours come and change, and how many of their objects the API server sent it (in lists
and watch events; 0 with server-side label selectors, ``kuberl_operator.watches``).

    python benchmarks/operator_neighbours.py --pods 5000

``--hostile``: the neighbours wear the operator's own labels instead (look-alikes the API server's
selector lets through): ``--configmaps`` ConfigMaps of 1 MiB with ``app.kubernetes.io/managed-by:
kuberl-operator`` and ``--pods`` pods labelled ``kuberl.io/role`` with a 200 KiB annotation, made
before the operator starts. An experiment beside them must reach Running, and another one after the
operator restarts; reports both operators' peak RSS (the cache holds what the operator controls only:
``kuberl_operator.cache``).

    python benchmarks/operator_neighbours.py --hostile --pods 5000 --configmaps 600

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

from benchmarks.operator_scale import (  # noqa: E402
    cpu_ms,
    create_at,
    instant_kubelet,
    peak_mib,
    report,
    running_times,
    start_operator,
    stop_operator,
)
from tests.harness import emulated_cluster  # noqa: E402
from tests.kube_emulator import KubeEmulator  # noqa: E402

from kuberl.api.contract import LABEL_ROLE, MANAGED_BY  # noqa: E402

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


async def look_alikes(api: KubeEmulator, pods: int, configmaps: int) -> None:
    """Objects of another team with the operator's labels: big ConfigMaps, pods with big annotations."""
    for i in range(configmaps):
        await api.create("", "configmaps", NAMESPACE, {"metadata": {"name": f"cm-{i:06d}", "labels": dict(MANAGED_BY)},
                                                       "data": {"blob": "x" * 2**20}})
    for i in range(pods):
        await api.create("", "pods", NAMESPACE, {
            "metadata": {"name": f"pod-{i:06d}", "labels": {LABEL_ROLE: "trainer", **MANAGED_BY},
                         "annotations": {"their/notes": "y" * 200 * 1024}},
            "spec": {"containers": [{"name": "main", "image": "theirs:1"}]}})


async def hostile(pods: int, configmaps: int, timeout: float, namespaces: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"hostile_pods": pods, "hostile_configmaps": configmaps,
                           "watching": list(namespaces) or "every namespace"}
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "operator.log", "wb") as log:
        async with emulated_cluster(Path(tmp)) as cluster:
            api = cluster.api
            await api.create("", "namespaces", None, {"metadata": {"name": NAMESPACE}})
            started = time.perf_counter()
            await look_alikes(api, pods, configmaps)
            out["look_alikes_seconds"] = round(time.perf_counter() - started, 1)
            kubelet = asyncio.create_task(instant_kubelet(api))
            try:
                for run, name in enumerate(("beside-them", "after-restart")):
                    operator = start_operator(cluster, log, qps=50.0, profile=None, namespaces=namespaces)
                    try:
                        created: dict[str, float] = {}
                        await create_at(api, name, created)
                        running = await running_times(api, created, timeout)
                        out[f"{name}_running_seconds"] = round(running[name], 2) if name in running else None
                        out[f"peak_mib_operator_{run + 1}"] = peak_mib(operator.pid)
                    finally:
                        stop_operator(operator)
            finally:
                kubelet.cancel()
    out["their_objects_sent_to_operator"] = sum(n for (plural, name), n in api.delivered.items()
                                                if name.startswith(("pod-", "cm-")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5000, help="another team's pods (and as many ConfigMaps)")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds to let the operator catch up")
    parser.add_argument("--hostile", action="store_true", help="look-alikes with the operator's labels instead")
    parser.add_argument("--configmaps", type=int, default=600, help="--hostile: ConfigMaps of 1 MiB")
    parser.add_argument("--timeout", type=float, default=180.0, help="--hostile: seconds to reach Running")
    parser.add_argument("--watch", action="append", default=[], help="--hostile: the operator watches only these "
                        "namespaces (the chart's default: its watchNamespaces); none: every namespace")
    args = parser.parse_args()
    if args.hostile:
        report(asyncio.run(hostile(args.pods, args.configmaps, args.timeout, tuple(args.watch))))
    else:
        report(asyncio.run(measure(args.pods, args.settle)))


if __name__ == "__main__":
    main()
