"""The whole path on one machine: real kubectl → API (emulator) → real operator → Pods run as
processes by the kubelet stand-in (e2e/kubelet.py) → workload → status → kubectl get; then
kubectl delete and nothing left behind. The scenario itself is e2e/scenario.py, which also runs
against a real cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from e2e import scenario
from filelock import FileLock

from .harness import ROOT, Cluster, emulated_cluster, running_operator
from .test_kubectl import kubectl_binary

STEPS = 150  # first-10 → last-10 reward rose by 0.12, 0.14, 0.22 in 80 steps (seeds 1–3); its noise ≈ 0.03;
# 150: a replica added once the trainer is up joins well before the end (at step 86 on a loaded 2-core host)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                       reason="the kubelet stand-in gives each pod a mount namespace: needs root and unshare"),
]  # fmt: skip


@pytest.fixture
def host_node() -> Iterator[None]:
    """One kubelet stand-in at a time on this host, for the whole test (taken before its cluster
    starts): every stand-in gives its pods the IPs 127.0.100.N, and torchrun's store listens on every
    address at 29500, so two at once (pytest-xdist workers, or two test runs) would take each other's
    ports. On a cluster each pod has its own network namespace."""
    with FileLock(Path(tempfile.gettempdir()) / "kuberl-kubelet-stand-in.lock"):
        yield


@contextlib.contextmanager
def kubelet_stand_in(cluster: Cluster, tmp_path: Path, faults: dict[str, str] | None = None) -> Iterator[Path]:
    """Run e2e/kubelet.py against ``cluster`` for the block; yields its node directory (pod logs).
    ``faults``: role → KUBERL_FAULT_INJECTION for that role's pods."""
    node_dir = tmp_path / "node"
    injected = [arg for role, value in (faults or {}).items() for arg in ("--fault-injection", f"{role}={value}")]
    kubelet = subprocess.Popen([sys.executable, "-m", "e2e.kubelet", "--kubeconfig", str(cluster.kubeconfig),
                                "--workdir", str(node_dir), *injected], cwd=ROOT,
                               stdout=open(tmp_path / "kubelet.log", "wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield node_dir
    finally:
        kubelet.send_signal(signal.SIGTERM)
        kubelet.wait(timeout=60)


def kubectl_for(cluster: Cluster) -> Callable[..., str]:
    """The real kubectl against ``cluster`` in namespace default; fails the test on a non-zero exit.
    Blocking: call it from a thread (the emulator runs on the test's event loop)."""
    def kubectl(*args: str) -> str:
        done = subprocess.run([kubectl_binary(), "--kubeconfig", str(cluster.kubeconfig), "-n", "default",
                               "--request-timeout=10s", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout
    return kubectl


def processes_under(path: Path) -> list[int]:
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(path) in (proc / "cmdline").read_bytes().decode(errors="replace") + os.readlink(proc / "cwd"):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


@pytest.mark.usefixtures("host_node")
@pytest.mark.slow
async def test_kubectl_apply_trains_to_succeeded_with_better_reward_and_delete_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "1")
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        with kubelet_stand_in(cluster, tmp_path) as node_dir:
            path, name = scenario.manifest(tmp_path / "experiment.yaml", STEPS)
            lines: list[str] = []
            kubectl = kubectl_for(cluster)
            scaled: list[str] = []

            def scale_once_running(status: dict[str, object]) -> None:  # a second replica while it trains
                if not scaled and "step" in (status.get("progress") or {}):  # the trainer is up: it must follow
                    scaled.append(kubectl("scale", "rlx", name, "--replicas=2"))

            outcome = await asyncio.to_thread(scenario.run, kubectl, path, name, 480, lines.append,
                                              scale_once_running)
        report = "\n".join(lines)
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(node_dir.glob("pods/*/container.log")))
        assert scenario.problems(outcome, STEPS) == [], f"{report}\n--- container logs ---\n{logs}"
        # the training trainer followed its pool to the second replica without a restart; the joiner's first
        # weights came over p2p
        [trainer] = [p.read_text(errors="replace") for p in node_dir.glob("pods/*trainer*/container.log")]
        [joiner] = [p.read_text(errors="replace") for p in node_dir.glob("pods/*inference-r1*/container.log")]
        assert "inference pool resized to 2 replicas" in trainer and "1 trainer ranks → 2 replicas" in trainer
        assert "resumed from" not in trainer, trainer[-3000:]
        assert re.search(r"received weights version \d+ over p2p", joiner), joiner[-3000:]
        assert "Succeeded" in outcome.tables[-1] and "STEP" in outcome.tables[0].upper()
        assert "rewardLast10" in outcome.yaml and "observedGeneration" in outcome.yaml
        assert all(key in outcome.yaml for key in ("rolloutWaitFraction", "rolloutReadyGroups", "stalenessBudgetUsed"))
        assert processes_under(node_dir) == [], "pod processes outlived kubectl delete"
        print(f"e2e: {outcome.seconds:.1f} s from apply to Succeeded; progress {outcome.progress}")


@pytest.mark.usefixtures("host_node")
@pytest.mark.slow
async def test_the_operators_autoscaler_grows_the_pool_of_a_training_run_whose_trainer_waits(tmp_path, monkeypatch):
    """spec.inference.autoscale on the emulated cluster with real pods: the replica is given a fraction of
    the capacity the trainer needs (injected by the kubelet stand-in: 4 requests at once, each held
    0.2 s), the operator reads the trainer's wait from its progress, scales the experiment through the
    scale subresource to its maximum of 2, records status.autoscale (the count it left remembered as too
    few) and an Event; the running trainer follows its mounted run config to the new replica without a
    restart, and the run still succeeds with a better reward."""
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "1")
    faults = {"inference": "generate-slots=4,generate-seconds=0.2"}  # 0.1 s: a loaded host's trainer waited 11 %
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        with kubelet_stand_in(cluster, tmp_path, faults) as node_dir:
            path, name = scenario.manifest(tmp_path / "experiment.yaml", STEPS)
            docs = list(yaml.safe_load_all(path.read_text()))
            # a 30 s window: the first change comes at once, and the count found too few stays remembered for
            # 6 windows, longer than the run — at 10 s a slow host ran past it and the pool went back to 1
            docs[0]["spec"]["inference"]["autoscale"] = {"maxReplicas": 2, "windowSeconds": 30}
            path.write_text(yaml.safe_dump_all(docs))
            kubectl, lines, events = kubectl_for(cluster), [], []

            def read_events(status: dict[str, object]) -> None:
                if status.get("autoscale") and not events:
                    events.append(kubectl("get", "events", "-o", "json"))

            outcome = await asyncio.to_thread(scenario.run, kubectl, path, name, 480, lines.append, read_events)
        report = "\n".join(lines)
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(node_dir.glob("pods/*/container.log")))
        assert scenario.problems(outcome, STEPS) == [], f"{report}\n--- container logs ---\n{logs}"
        final = yaml.safe_load(outcome.yaml)
        assert final["spec"]["inference"]["replicas"] == 2, report
        autoscaled = final["status"]["autoscale"]
        assert (autoscaled["replicas"], autoscaled["tooFew"]) == (2, 1) and "waited" in autoscaled["reason"]
        [event] = [e for e in json.loads(events[0])["items"] if e["reason"] == "Autoscaled"]
        assert event["type"] == "Normal" and "1 → 2 inference replicas" in event["message"]
        [trainer] = [p.read_text(errors="replace") for p in node_dir.glob("pods/*trainer*/container.log")]
        assert "inference pool resized to 2 replicas" in trainer and "resumed from" not in trainer, trainer[-3000:]
        [joiner] = [p.read_text(errors="replace") for p in node_dir.glob("pods/*inference-r1*/container.log")]
        assert re.search(r"received weights version \d+ over p2p", joiner) and "POST /generate" in joiner


AGENT_STEPS = 8


@pytest.mark.usefixtures("host_node")
@pytest.mark.slow
async def test_the_users_agent_deployment_trains_the_policy_through_the_gateway_service(tmp_path, monkeypatch):
    """spec.agent on the emulator: the operator makes the agent's Deployment and the gateway's
    Service; the Deployment's pod (examples/agents/calculator_agent.py, the openai client) reaches the
    gateway by the Service's DNS name, and its episodes are all the trainer trains on."""
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "1")
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        with kubelet_stand_in(cluster, tmp_path) as node_dir:
            example = ROOT / "examples/cpu-agent-gateway.yaml"
            # the wiring is under test here, not learning (tests/test_local_run.py has that): half the
            # example's episodes per step, a shorter warm-up
            path, name = scenario.manifest(tmp_path / "agent.yaml", AGENT_STEPS, example, {"batchSize": 64}, 20)
            kubectl = kubectl_for(cluster)
            lines: list[str] = []
            deployments: list[str] = []

            def watch(status: dict[str, object]) -> None:
                if not deployments:  # the first status may come before the operator's agent step made it
                    listed = kubectl("get", "deployments", "-o", "name")
                    deployments.extend([listed] if listed else [])

            outcome = await asyncio.to_thread(scenario.run, kubectl, path, name, 480, lines.append, watch)
        agent_logs = [p.read_text(errors="replace") for p in node_dir.glob(f"pods/*{name}-agent-*/container.log")]
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(node_dir.glob("pods/*/container.log")))
        assert scenario.problems(outcome, AGENT_STEPS, learning=False) == [], "\n".join(lines) + logs
        assert deployments == [f"deployment.apps/{name}-agent\n"]
        assert agent_logs, "the agent Deployment's pod never ran"
        assert "never answered" not in "".join(agent_logs)
        assert processes_under(node_dir) == [], "pod processes outlived kubectl delete"


def test_kubelet_stand_in_expands_like_a_kubelet():
    from e2e.kubelet import dns_names, expand, field_value

    assert expand("--rank=$(NODE_RANK) --x=$(UNSET)", {"NODE_RANK": "3"}) == "--rank=3 --x=$(UNSET)"
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {"b": "2", "a": 'say "hi"'}},
           "spec": {"hostname": "h", "subdomain": "svc", "nodeName": "n1"}}  # fmt: skip
    assert field_value(pod, "metadata.labels", "127.0.100.1") == 'a="say \\"hi\\""\nb="2"\n'
    assert field_value(pod, "spec.nodeName", "ip") == "n1" and field_value(pod, "status.podIP", "ip") == "ip"
    assert dns_names(pod) == ["h.svc", "h.svc.ns", "h.svc.ns.svc", "h.svc.ns.svc.cluster.local"]


def test_final_progress_comes_from_the_termination_message():
    from kuberl_operator.progress import progress_status, termination_progress

    message = '{"step": 150, "version": 150, "reward": 0.5, "reward_first10": 0.3}'
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 0, "message": message}}}]}}
    assert progress_status(termination_progress(pod) or {}) == {"step": 150, "version": 150, "reward": 0.5,
                                                                "rewardFirst10": 0.3}  # fmt: skip
    crashed = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "message": "Traceback..."}}}]}}
    assert termination_progress(crashed) is None and termination_progress(None) is None


def test_mounts_keep_the_image_visible_under_an_emptydir_on_tmp(tmp_path):
    from e2e.kubelet import mount_commands

    scratch, config = tmp_path / "scratch", tmp_path / "config"
    scratch.mkdir()
    config.mkdir()
    commands = mount_commands([(scratch, "/tmp"), (config, "/etc/kuberl/config")], ["/tmp/ci/repo", "/opt/venv"])
    config_at = commands.index(f"mount --rbind {config} /etc/kuberl/config")
    assert config_at < commands.index(f"mount --rbind {scratch} /tmp")
    assert f"mount --bind /tmp/ci/repo {scratch}/ci/repo" in commands  # shows through the /tmp mount
    assert not any("/opt/venv" in c for c in commands)
