"""The real kubectl binary against the operator + emulated API server."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from .harness import GROUP, ROOT, bind, emulated_cluster, eventually, pods, running_operator, set_pod

pytestmark = pytest.mark.integration


def kubectl_binary() -> str:
    ours = Path(sys.executable).parent / "kubectl"  # the v1.35 binary scripts/setup installs
    found = str(ours) if ours.exists() else shutil.which("kubectl") or str(ours)
    if not Path(found).exists():
        pytest.fail("kubectl is not installed: run scripts/setup (it extracts kubectl into .venv/bin)")
    return found


async def kubectl(config: Path, *args: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(config), "--request-timeout=10s", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {err.decode()}")
    return out.decode()


@pytest.mark.slow
async def test_kubectl_apply_get_and_delete(tmp_path):
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api, cfg = cluster.api, cluster.kubeconfig
        manifest = str(ROOT / "examples/cpu-tiny.yaml")
        out = await kubectl(cfg, "apply", "--validate=false", "-n", "team-a", "-f", manifest)
        assert "rlexperiment.kuberl.io/cpu-tiny created" in out
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        for pod in pods(api, "team-a"):
            await bind(api, pod, "node-a")
            await set_pod(api, pod, "Running", ready=True)
        await eventually(lambda: api.get(GROUP, "rlexperiments", "team-a", "cpu-tiny")["status"]["phase"] == "Running",
                         what="Running")
        # Stand-in for the trainer's progress, which the operator copies into status.progress.
        await api.patch(GROUP, "rlexperiments", "team-a", "cpu-tiny",
                        {"status": {"progress": {"step": 12, "version": 12, "reward": 0.625, "observedStaleness": 2}}},
                        subresource="status")

        table = (await kubectl(cfg, "get", "rlx", "-n", "team-a")).splitlines()
        assert table[0].split() == ["NAME", "PHASE", "STEP", "VERSION", "REWARD", "OBSERVED-STALENESS", "EVAL", "AGE"]
        assert table[1].split()[:6] == ["cpu-tiny", "Running", "12", "12", "0.625", "2"]
        wide = (await kubectl(cfg, "get", "rlx", "-n", "team-a", "-o", "wide")).splitlines()
        assert wide[0].split()[-1] == "LAST-EXPORT"  # -o wide: where the trained model is (none yet)

        kinds = await kubectl(cfg, "get", "kuberl", "-n", "team-a", "-o", "name")
        assert set(kinds.split()) == {"rlexperiment.kuberl.io/cpu-tiny", "inferencepool.kuberl.io/cpu-tiny-inference",
                                      "trainerjob.kuberl.io/cpu-tiny-trainer"}
        pools = (await kubectl(cfg, "get", "rlpool", "-n", "team-a")).splitlines()
        assert pools[1].split()[:6] == ["cpu-tiny-inference", "Running", "torch", "1", "1", "cpu"]

        fetched = await kubectl(cfg, "get", "rlexperiments.kuberl.io", "cpu-tiny", "-n", "team-a", "-o", "yaml")
        doc = yaml.safe_load(fetched)
        assert doc["status"]["phase"] == "Running"
        assert {c["type"]: c["status"] for c in doc["status"]["conditions"]} == {
            "SpecValid": "True", "Ready": "True", "Degraded": "False"}

        out = await kubectl(cfg, "delete", "-n", "team-a", "-f", manifest)
        assert 'rlexperiment.kuberl.io "cpu-tiny" deleted' in out
        await eventually(lambda: not pods(api, "team-a") and not api.list(GROUP, "trainerjobs", "team-a"),
                         what="cleanup")
