"""How the operator scales with the number of experiments.

Runs the real operator (``kuberl operator``, its own process) against the emulated API server with
an instant kubelet (a pod is Running and Ready the moment it is created), then:

1. one experiment on the idle operator: create → phase Running (the first it sees, and the median
   of five more, one at a time: warm);
2. ``--experiments N`` created at once: create → Running per experiment (p50, p95, max) and the time
   until all are Running;
3. the operator restarted beside them (an upgrade): how long until it is quiet again, its CPU, and
   the requests it made (everything is as it should be: it should write nothing);
4. a pool of 1,024 replicas (the CRD's most) next to them: the operator's peak RSS.

Reports the operator's CPU milliseconds per experiment (utime + stime from /proc; the emulated API
server's and instant kubelet's too: this process, the other half of two cores), its peak RSS
(VmHWM), the API requests it made per experiment (reads: get/list; writes: create/patch/
delete/update; watches are long-lived and counted apart) and the watch events it received per
experiment (every change of a kind it watches: its own writes' echoes and the kubelet's; kopf's own
cost per event is ``kopf_floor.py``'s).

    python benchmarks/operator_scale.py --experiments 1000

The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import load_example  # noqa: E402
from tests.harness import GROUP, emulated_cluster  # noqa: E402
from tests.kube_emulator import ApiError, KubeEmulator  # noqa: E402

READS, WRITES = ("get", "list"), ("create", "patch", "update", "delete")
UNWATCHED = ("secrets", "namespaces")  # plurals the operator does not watch
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICKS  # utime + stime


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM")


async def instant_kubelet(api: KubeEmulator) -> None:
    """Every new pod: bound, Running and Ready at once (its IP from a counter)."""
    seen, ip = 0, 0
    while True:
        async with api.changed:
            await api.changed.wait_for(lambda seen=seen: len(api.log) > seen)
        entries, seen = api.log[seen:], len(api.log)
        for _, key, kind, obj in entries:
            if key != ("", "pods") or kind != "ADDED":
                continue
            ip += 1
            meta = obj["metadata"]
            container = obj["spec"]["containers"][0]["name"]
            status = {"phase": "Running", "podIP": f"10.{ip // 65536 % 256}.{ip // 256 % 256}.{ip % 256}",
                      "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
                      "containerStatuses": [{"name": container, "ready": True, "state": {"running": {}}}]}
            try:
                await api.patch("", "pods", meta["namespace"], meta["name"], {"status": status}, subresource="status")
            except ApiError as err:
                if err.status != 404:  # 404: deleted meanwhile
                    raise


EXAMPLE = load_example("cpu-tiny.yaml")


def experiment(name: str) -> dict[str, Any]:
    """The example under ``name`` (parsed once: parsing its YAML takes ~8 ms, which an earlier version
    of this benchmark counted in every create → Running)."""
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"].update(name=name, namespace="team-a")
    return doc


async def create_at(api: KubeEmulator, name: str, created: dict[str, float]) -> None:
    """Create experiment ``name``, noting when the request went out."""
    doc = experiment(name)
    created[name] = time.perf_counter()
    await api.create(GROUP, "rlexperiments", "team-a", doc)


async def running_times(api: KubeEmulator, created: dict[str, float], timeout: float) -> dict[str, float]:
    """Seconds from each experiment's creation until its phase first reads Running."""
    done: dict[str, float] = {}
    deadline = time.perf_counter() + timeout
    while len(done) < len(created) and time.perf_counter() < deadline:
        now = time.perf_counter()
        for (_, name), obj in list(api.store[(GROUP, "rlexperiments")].items()):
            if name in created and name not in done and (obj.get("status") or {}).get("phase") == "Running":
                done[name] = now - created[name]
        await asyncio.sleep(0.002 if len(created) == 1 else 0.02)  # a single one: to the millisecond
    return done


def wide_pods(api: KubeEmulator) -> int:
    """The pool "wide"'s pods, counted in the store (a list would copy a thousand pods twice a second)."""
    return sum(1 for pod in api.store[("", "pods")].values()
               if (pod["metadata"].get("labels") or {}).get("kuberl.io/inference-pool") == "wide")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_operator(cluster: Any, log: Any, qps: float, profile: str | None,
                   namespaces: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """``kuberl operator`` in its own process, against the emulator (watching ``namespaces``; none: all)."""
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    watch = [f"--namespace={namespace}" for namespace in namespaces]
    return subprocess.Popen([sys.executable, *profiler, "-m", "kuberl_cli", "operator", *watch],
                            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                                 "KUBERL_PROGRESS_SECONDS": "3600", "KUBERL_API_QPS": str(qps),
                                 "KUBERL_API_BURST": str(int(2 * qps))},
                            stdout=subprocess.DEVNULL, stderr=log)


def stop_operator(operator: subprocess.Popen[bytes]) -> None:
    operator.terminate()
    try:
        operator.wait(30)
    except subprocess.TimeoutExpired:
        operator.kill()
        operator.wait()


def requests_made(api: KubeEmulator, before: dict[str, int], n: int) -> dict[str, Any]:
    """The API requests since ``before``, per experiment: reads, writes and each verb."""
    used = {k: v - before.get(k, 0) for k, v in api.requests.items()}
    return {"reads": round(sum(used.get(k, 0) for k in READS) / n, 1),
            "writes": round(sum(used.get(k, 0) for k in WRITES) / n, 1),
            "by_verb": {k: round(v / n, 2) for k, v in sorted(used.items()) if v}}


async def single_phase(api: KubeEmulator, out: dict[str, Any]) -> None:
    """One experiment on the idle operator, then five more one at a time (code paths warm)."""
    created: dict[str, float] = {}
    await create_at(api, "single", created)
    single = await running_times(api, created, 30)
    out["single_create_to_running_ms"] = round(single.get("single", float("nan")) * 1000, 1)
    await asyncio.sleep(2)
    warm: list[float] = []
    for i in range(5):
        created = {}
        await create_at(api, f"warm-{i}", created)
        warm += (await running_times(api, created, 30)).values()
        await asyncio.sleep(1)
    out["single_warm_create_to_running_ms"] = round(statistics.median(warm) * 1000, 1)


async def burst_phase(api: KubeEmulator, pid: int, n: int, timeout: float, out: dict[str, Any]) -> None:
    """``n`` experiments created at once: create → Running, CPU, requests and watch events each."""
    cpu0, requests0, api_cpu0 = cpu_ms(pid), dict(api.requests), cpu_ms(os.getpid())
    events0 = len(api.log)
    start = time.perf_counter()
    created: dict[str, float] = {}
    for i in range(n):
        await create_at(api, f"exp-{i:05d}", created)
    times = await running_times(api, created, timeout)
    out["created_seconds"] = round(max(created.values()) - start, 2)
    out["running"] = len(times)
    out["all_running_seconds"] = round(time.perf_counter() - start, 2) if len(times) == n else None
    values = list(times.values()) or [float("nan")]
    out.update(p50_ms=round(statistics.median(values) * 1000, 1),
               p95_ms=round(percentile(values, 0.95) * 1000, 1), max_ms=round(max(values) * 1000, 1))
    await asyncio.sleep(3)  # the last status writes settle
    out["cpu_ms_per_experiment"] = round((cpu_ms(pid) - cpu0) / n, 1)
    out["api_server_cpu_ms_per_experiment"] = round((cpu_ms(os.getpid()) - api_cpu0) / n, 1)
    out["requests_per_experiment"] = requests_made(api, requests0, n)
    out["watch_events_per_experiment"] = round(
        sum(1 for _, key, _, _ in api.log[events0:] if key[1] not in UNWATCHED) / n, 1)
    out["peak_mib_after_experiments"] = peak_mib(pid)


async def quiet(api: KubeEmulator, pid: int, timeout: float, still: float = 3.0) -> float:
    """Seconds until the operator has made no request and used no CPU for ``still`` seconds (minus those)."""
    start = time.perf_counter()
    last_change, seen = start, (dict(api.requests), cpu_ms(pid))
    while time.perf_counter() - last_change < still and time.perf_counter() - start < timeout:
        await asyncio.sleep(0.25)
        now = (dict(api.requests), cpu_ms(pid))
        if now != seen:
            last_change, seen = time.perf_counter(), now
    return last_change - start


async def restart_phase(api: KubeEmulator, start: Callable[[], subprocess.Popen[bytes]],
                        operator: subprocess.Popen[bytes], n: int, timeout: float,
                        out: dict[str, Any]) -> subprocess.Popen[bytes]:
    """The operator restarted (an upgrade, a node drain) beside ``n`` Running experiments: it re-lists
    and re-syncs everything; how long until it is quiet, its CPU, and what it wrote (nothing changed,
    so it should write nothing)."""
    stop_operator(operator)
    requests0 = dict(api.requests)
    operator = start()
    settled = await quiet(api, operator.pid, timeout)
    out["restart"] = {"seconds_to_quiet": round(settled, 1), "cpu_ms": cpu_ms(operator.pid),
                      "requests_per_experiment": requests_made(api, requests0, n),
                      "peak_mib": peak_mib(operator.pid)}
    return operator


async def wide_pool_phase(api: KubeEmulator, pid: int, timeout: float, out: dict[str, Any]) -> None:
    """A pool of 1,024 replicas beside the experiments: its pods' time and the operator's peak RSS."""
    pool = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferencePool", "metadata": {"name": "wide"},
            "spec": {"engine": "torch", "replicas": 1024}}
    await api.create(GROUP, "inferencepools", "team-a", pool)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline and wide_pods(api) < 1024:
        await asyncio.sleep(0.5)
    out["pool_1024_pods_seconds"] = round(time.perf_counter() - deadline + timeout, 1)
    out["peak_mib_with_1024_pod_pool"] = peak_mib(pid)


async def measure(n: int, timeout: float, qps: float, profile: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"experiments": n, "api_qps": qps}
    with tempfile.TemporaryDirectory() as tmp:
        async with emulated_cluster(Path(tmp)) as cluster:
            api = cluster.api
            kubelet = asyncio.create_task(instant_kubelet(api))
            log = (Path(tmp) / "operator.log").open("w")
            operator = start_operator(cluster, log, qps, profile)
            try:
                await asyncio.sleep(6)  # started, listed everything, idle
                out["peak_mib_idle"] = peak_mib(operator.pid)
                await single_phase(api, out)
                await burst_phase(api, operator.pid, n, timeout, out)
                operator = await restart_phase(api, lambda: start_operator(cluster, log, qps, None), operator, n,
                                               timeout, out)
                await wide_pool_phase(api, operator.pid, timeout, out)
            finally:
                stop_operator(operator)
                kubelet.cancel()
                log.close()
                out["operator_log_tail"] = (Path(tmp) / "operator.log").read_text().splitlines()[-3:]
    return out


def report(result: dict[str, Any]) -> None:
    """The operator benchmarks' output: a line per measure, then all of it as JSON (the last line)."""
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all to be Running")
    parser.add_argument("--qps", type=float, default=2000.0, help="the operator's client-side rate limit (burst: 2×)")
    parser.add_argument("--profile", metavar="PATH", help="run the operator under cProfile, its stats written here "
                        "(pstats; the profiler's overhead inflates the CPU numbers)")
    args = parser.parse_args()
    report(asyncio.run(measure(args.experiments, args.timeout, args.qps, args.profile)))


if __name__ == "__main__":
    main()
