"""The operator's peak memory while a tenant's oversized objects are around.

Runs the real operator (``kuberl operator``, its own process) against the emulated API server
(which, unlike a real one, does not apply the CRD's bounds, so the objects reach the operator),
then creates an RLExperiment asking for 100,000 inference replicas, an InferencePool asking for
100,000 replicas, and a pool at the allowed maximum (1,024 replicas: 1,024 pods). Reports the
operator process's peak RSS (VmHWM) after each and the status the oversized ones got.

    python benchmarks/oversized_object.py

The last line is JSON.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import load_example  # noqa: E402
from tests.harness import GROUP, emulated_cluster, eventually  # noqa: E402


def peak_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM")


async def status_of(api, plural: str, name: str) -> dict:
    return await eventually(lambda: api.get(GROUP, plural, "team-a", name).get("status"), timeout=60,
                            what=f"{plural}/{name} status")


async def main() -> dict[str, object]:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with emulated_cluster(Path(tmp)) as cluster:
            api = cluster.api
            operator = subprocess.Popen([sys.executable, "-m", "kuberl_cli", "operator"],
                                        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.sleep(8)  # started and listed everything
            pid = operator.pid
            out["peak_mib_idle"] = peak_mib(pid)
            doc = load_example("cpu-tiny.yaml")
            doc["metadata"]["namespace"] = "team-a"
            huge = copy.deepcopy(doc)
            huge["metadata"]["name"] = "huge"
            huge["spec"]["inference"]["replicas"] = 100_000
            await api.create(GROUP, "rlexperiments", "team-a", huge)
            status = await status_of(api, "rlexperiments", "huge")
            out["experiment_100k_phase"] = status.get("phase")
            conditions = {c["type"]: c for c in status["conditions"]}
            out["experiment_100k_message"] = conditions["SpecValid"]["message"]
            out["peak_mib_after_100k_experiment"] = peak_mib(pid)
            pool = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "InferencePool",
                    "metadata": {"name": "huge-pool", "namespace": "team-a"},
                    "spec": {"accelerator": "cpu", "engine": "torch", "replicas": 100_000}}
            await api.create(GROUP, "inferencepools", "team-a", pool)
            out["pool_100k_phase"] = (await status_of(api, "inferencepools", "huge-pool")).get("phase")
            out["pods_for_100k_pool"] = len(api.list("", "pods", "team-a", "kuberl.io/inference-pool=huge-pool"))
            out["peak_mib_after_100k_pool"] = peak_mib(pid)
            started = time.monotonic()
            biggest = copy.deepcopy(pool)
            biggest["metadata"]["name"] = "max-pool"
            biggest["spec"]["replicas"] = 1024
            await api.create(GROUP, "inferencepools", "team-a", biggest)
            await eventually(lambda: len(api.list("", "pods", "team-a", "kuberl.io/inference-pool=max-pool")) == 1024,
                             timeout=600, what="1024 pods")
            out["seconds_to_1024_pods"] = round(time.monotonic() - started, 1)
            out["peak_mib_after_1024_pods"] = peak_mib(pid)
            operator.kill()  # kopf waits for the emulator's open watch streams on a SIGTERM
            operator.wait(30)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
