"""Run the real operator (kopf, our handlers) against the emulated API server, in-process.

Tests play the scheduler and the kubelet by patching pods (``bind``, ``set_pod``), exactly as a
real kubelet would report: ``spec.nodeName`` on the object, phase and container states in status.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock

from .kube_emulator import KubeEmulator, kubeconfig
from .kube_rbac import OPERATOR_TOKEN, operator_grants

ROOT = Path(__file__).resolve().parent.parent
GROUP = "kuberl.io"


@dataclass
class Cluster:
    api: KubeEmulator
    url: str
    kubeconfig: Path


@contextlib.asynccontextmanager
async def emulated_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with KubeEmulator() as api, kmock.Server(api) as server:
        api.register_crds(ROOT / "crds")
        url = str(server.url).rstrip("/")
        config = tmp_path / "kubeconfig"
        config.write_text(kubeconfig(url))
        for ns in ("default", "team-a"):
            await api.create("", "namespaces", None, {"metadata": {"name": ns}})
        yield Cluster(api, url, config)


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, namespaces: list[str] | None = None) -> AsyncIterator[None]:
    """Start the operator (as `kuberl operator` would; watching only ``namespaces`` when given), with
    exactly the chart's RBAC for that scope (``kube_rbac``), and stop it cleanly afterwards; a request
    that RBAC refused fails the test, naming it (a missing verb fails here, not on a cluster)."""
    import kopf

    from kuberl_operator import handlers  # registers the handlers

    operator_config = cluster.kubeconfig.with_name("operator-kubeconfig")
    operator_config.write_text(kubeconfig(cluster.url, OPERATOR_TOKEN))
    cluster.api.identities[OPERATOR_TOKEN] = operator_grants(tuple(namespaces) if namespaces else None)
    os.environ["KUBECONFIG"] = str(operator_config)
    ready = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, ready_flag=ready, **handlers.operator_scope(namespaces)))
    try:
        await asyncio.wait_for(ready.wait(), timeout=20)
        yield
    finally:
        # kopf counts every task born after its start as its own, the emulator's open watch
        # streams included, and would give them a 5 s grace period on a stop flag; a
        # cancellation ends them at once, like SIGTERM to a pod.
        task.cancel()
        await _stopped(task, timeout=20)
        ours = [t for t in asyncio.all_tasks()
                if t.get_name() == handlers.PROGRESS_TASK or t.get_name().startswith(handlers.RETRY_TASK)]
        for background in ours:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
    assert not cluster.api.forbidden, f"the chart's RBAC refused the operator: {sorted(set(cluster.api.forbidden))}"


async def _stopped(task: asyncio.Task[Any], timeout: float) -> None:
    """Wait for a cancelled ``task``; if it has not ended within ``timeout`` seconds, fail naming the
    tasks still running and where each waits (``asyncio.wait_for`` would wait for ever after its
    timeout: it awaits the task it cancels)."""
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done:
        with contextlib.suppress(asyncio.CancelledError):
            task.result()
        return
    stacks = io.StringIO()
    for running in asyncio.all_tasks():
        if running is not asyncio.current_task():
            running.print_stack(limit=6, file=stacks)
    raise AssertionError(f"the operator did not stop within {timeout} s; tasks still running:\n{stacks.getvalue()}")


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value (or stops raising AssertionError)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError) as err:
            last = err
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def pods(api: KubeEmulator, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
    return api.list("", "pods", namespace, selector)


async def bind(api: KubeEmulator, pod: dict[str, Any], node: str) -> None:
    """The scheduler's part: put the pod on ``node``."""
    meta = pod["metadata"]
    await api.patch("", "pods", meta["namespace"], meta["name"], {"spec": {"nodeName": node}})
    await api.patch("", "pods", meta["namespace"], meta["name"], {"status": {"conditions": [
        {"type": "PodScheduled", "status": "True"}]}}, subresource="status")


async def set_pod(api: KubeEmulator, pod: dict[str, Any], phase: str, ready: bool = False,
                  waiting: tuple[str, str] | None = None, exit_code: int | None = None) -> None:
    """The kubelet's part: report phase, readiness and container state."""
    container = pod["spec"]["containers"][0]["name"]
    state: dict[str, Any] = {"running": {}}
    if waiting:
        state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    elif exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}}
    status = {
        "phase": phase,
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": container, "ready": ready, "state": state}],
    }
    meta = pod["metadata"]
    await api.patch("", "pods", meta["namespace"], meta["name"], {"status": status}, subresource="status")


async def preempt(api: KubeEmulator, pod: dict[str, Any], reason: str = "PreemptionByScheduler",
                  kind: str = "DisruptionTarget") -> None:
    """The control plane's part when it takes a running pod away (the scheduler for a higher-priority
    pod, an eviction for a drain): the ``DisruptionTarget`` condition, before the pod is ended; Kueue
    for a plain-pod group writes ``TerminationTarget`` (reason ``StoppedByKueue``) and deletes it."""
    meta = pod["metadata"]
    await api.patch("", "pods", meta["namespace"], meta["name"], {"status": {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"},
        {"type": kind, "status": "True", "reason": reason,
         "message": f"{reason}: the cluster needs this pod's resources"}]}}, subresource="status")


async def running_experiment(api: KubeEmulator, doc: dict[str, Any], pod_count: int,
                             namespace: str = "team-a") -> dict[str, Any]:
    """Create the RLExperiment ``doc``, play scheduler and kubelet for its ``pod_count`` pods (bound to
    node-a, Running and Ready) and return it once its phase is Running."""
    name = doc["metadata"]["name"]
    await api.create(GROUP, "rlexperiments", namespace, doc)
    await eventually(lambda: len(pods(api, namespace)) == pod_count, what=f"{pod_count} pods")
    for pod in pods(api, namespace):
        await bind(api, pod, "node-a")
        await set_pod(api, pod, "Running", ready=True)

    def running() -> dict[str, Any] | None:
        exp = api.get(GROUP, "rlexperiments", namespace, name)
        return exp if (exp.get("status") or {}).get("phase") == "Running" else None

    return await eventually(running, what=f"{name} Running")
