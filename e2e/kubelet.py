"""A kubelet stand-in for the end-to-end test: Pods become local processes.

``python -m e2e.kubelet --kubeconfig K --node NAME --workdir DIR`` registers a Node (with
topology labels), binds every unscheduled Pod to it (the scheduler's part), and runs each bound
Pod's first container as a process, the way a kubelet would:

- command/args with ``$(VAR)`` expanded from the container env; env values, ``fieldRef``s
  (metadata.name/namespace/labels, status.podIP, spec.nodeName) and ``secretKeyRef``s resolved
  (a missing Secret or key holds the container back until it exists);
- every Pod gets its own loopback IP (127.0.100.N) as ``status.podIP``, and a private mount
  namespace (``unshare``) in which its volumes sit at their mount paths — ConfigMaps and
  downward-API files (refreshed when labels change) and emptyDirs — and ``/etc/hosts`` holds the
  cluster's DNS names (``<hostname>.<subdomain>[.<ns>.svc.cluster.local]``) for every Pod;
- phase, container state (with the termination message: the file at ``terminationMessagePath``,
  or the log tail for ``FallbackToLogsOnError``), restart count and the Ready condition (from
  httpGet startup and readiness probes) are reported on the Pod's status; ``restartPolicy`` is
  honoured;
- a Pod that is deleted has its process group terminated (SIGTERM, then SIGKILL after 10 s).

It also does two jobs of the control plane: a Deployment's pods are kept at ``replicas`` (named
``<deployment>-<template hash>-<i>``; a changed template replaces them all at once), and a Service
with a selector resolves by name (``<svc>[.<ns>[.svc[.cluster.local]]]`` in ``/etc/hosts``) to the
IP of a running pod it selects (what kube-proxy's virtual IP would reach).

What it does not do: images (every container runs this repository's venv; the workload image's
``/opt/kuberl/examples`` is this repository's ``examples/``), resource limits, ``securityContext``
users (processes run as the runner's user), liveness kills, exec probes.
Needs root (mount namespaces); the test skips with that reason elsewhere.

Faults come from here, as a chaos tool injects them into pods: ``--fault-injection ROLE=VALUE``
gives every container of a pod labelled ``kuberl.io/role=ROLE`` the environment variable
``KUBERL_FAULT_INJECTION=VALUE`` (``kuberl.inference.faults``), which the operator never sets.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kuberl.api.contract import ENV_FAULT_INJECTION, LABEL_ROLE

Manifest = dict[str, Any]
GRACE_SECONDS = 10
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables are replaced, unknown ones stay as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, from the parent ids in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class ContainerConfigError(RuntimeError):
    """A Secret or key the container's env refers to is missing (CreateContainerConfigError); the
    kubelet retries on its next sync, as a real one does."""


def secret_value(kube: Any, namespace: str, ref: Manifest) -> str | None:
    """The decoded value of a ``secretKeyRef``; None when it is missing and ``optional``."""
    secret = kube.get("v1", "Secret", namespace, ref["name"])
    data = (secret or {}).get("data") or {}
    if ref["key"] in data:
        return base64.b64decode(data[ref["key"]]).decode()
    if ref.get("optional"):
        return None
    raise ContainerConfigError(f"secret {ref['name']!r} key {ref['key']!r} not found")


def field_value(pod: Manifest, path: str, ip: str) -> str:
    if path == "status.podIP":
        return ip
    if path == "metadata.labels":
        return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted((pod["metadata"].get("labels") or {}).items()))
    if path == "metadata.annotations":
        annotations = pod["metadata"].get("annotations") or {}
        return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items()))
    node: Any = pod
    for part in path.split("."):
        node = (node or {}).get(part)
    return "" if node is None else str(node)


def mount_commands(binds: list[tuple[Path, str]], keep_visible: list[str]) -> list[str]:
    """Shell commands that bind every (source, mount path) pair inside the pod's mount namespace.

    A mount that covers another mount's source (an emptyDir on /tmp over a work dir in /tmp) comes
    last, or that source would be hidden first; and the paths in ``keep_visible`` (the "image": the
    repository and its venv, which may well live under /tmp) are bound into such a mount's source
    first, so they show through it (hence ``--rbind``).
    """
    q = shlex.quote
    sources = [str(src) for src, _ in binds]
    ordered = sorted(binds, key=lambda b: any(src.startswith(b[1].rstrip("/") + "/") for src in sources))
    out = []
    for src, target in ordered:
        prefix = target.rstrip("/") + "/"
        for path in keep_visible:
            if path.startswith(prefix) and src.is_dir():
                inner = f"{src}/{path[len(prefix):]}"
                out += [f"mkdir -p {q(inner)}", f"mount --bind {q(path)} {q(inner)}"]
        out.append(f"mkdir -p {q(target)}" if src.is_dir() else f"touch {q(target)}")
        out.append(f"mount --rbind {q(str(src))} {q(target)}")
    return out


def selects(selector: dict[str, str], labels: dict[str, str] | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def deployment_pods(deployment: Manifest, pods: list[Manifest]) -> tuple[list[Manifest], list[str]]:
    """(pods to create, names of pods to delete) that bring ``deployment`` to its replicas."""
    meta, spec = deployment["metadata"], deployment["spec"]
    template = spec["template"]
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]
    wanted = {f"{meta['name']}-{digest}-{i}" for i in range(spec.get("replicas", 1))}
    owned = [p["metadata"]["name"] for p in pods
             if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences") or [])]
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"], "uid": meta["uid"],
             "controller": True, "blockOwnerDeletion": True}
    create = [{"apiVersion": "v1", "kind": "Pod",
               "metadata": {**template.get("metadata", {}), "name": name, "namespace": meta["namespace"],
                            "ownerReferences": [owner]},
               "spec": {"restartPolicy": "Always", **template["spec"]}}
              for name in sorted(wanted - set(owned))]
    return create, sorted(set(owned) - wanted)


def container_policy(pod: Manifest) -> str:
    return pod["spec"]["containers"][0].get("terminationMessagePolicy") or "File"


def dns_names(pod: Manifest) -> list[str]:
    spec, ns = pod["spec"], pod["metadata"]["namespace"]
    if not (spec.get("hostname") and spec.get("subdomain")):
        return []
    base = f"{spec['hostname']}.{spec['subdomain']}"
    return [base, f"{base}.{ns}", f"{base}.{ns}.svc", f"{base}.{ns}.svc.cluster.local"]


@dataclass
class Running:
    pod: Manifest
    ip: str
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started: bool = False  # startup probe passed
    ready: bool = False
    reported: str = ""
    terminal: str | None = None  # Succeeded / Failed once the container will not run again
    exit_code: int | None = None
    files: dict[Path, str] = field(default_factory=dict)


class Kubelet:
    def __init__(self, kube: Any, node: str, workdir: Path, venv_bin: Path, faults: dict[str, str] | None = None):
        """``faults``: role → ``KUBERL_FAULT_INJECTION`` for that role's pods."""
        self.kube, self.node, self.workdir, self.venv_bin = kube, node, workdir, venv_bin
        self.faults = faults or {}
        self.image_paths = [str(Path(__file__).resolve().parent.parent), sys.prefix]  # what "the image" holds
        self.pods: dict[tuple[str, str], Running] = {}
        self.hosts = workdir / "hosts"
        self.next_ip = 1
        self.services: list[Manifest] = []
        self.image_dirs = [(Path(__file__).resolve().parent.parent / "examples", "/opt/kuberl/examples")]

    # -- API -------------------------------------------------------------------------------------
    def register_node(self) -> None:
        if self.kube.get("v1", "Node", None, self.node) is None:
            self.kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
                "kubernetes.io/hostname": self.node, "topology.kubernetes.io/zone": "e2e-zone-a",
                "topology.kubernetes.io/rack": "e2e-rack-1"}}, "status": {"allocatable": {"cpu": "2"}}})  # fmt: skip

    def report(self, run: Running) -> None:
        meta = run.pod["metadata"]
        name = run.pod["spec"]["containers"][0]["name"]
        if run.terminal:
            state: Manifest = {"terminated": {"exitCode": run.exit_code, "finishedAt": now(),
                                              "reason": "Completed" if run.exit_code == 0 else "Error"}}  # fmt: skip
            message = (run.root / "termination-log").read_text()[:4096]
            if not message and run.exit_code and container_policy(run.pod) == "FallbackToLogsOnError":
                message = "\n".join((run.root / "container.log").read_text(errors="replace").splitlines()[-80:])[-2048:]
            if message:
                state["terminated"]["message"] = message
            phase = run.terminal
        else:
            state, phase = {"running": {"startedAt": now()}}, "Running"
        ready = "True" if run.ready and not run.terminal else "False"
        status = {"phase": phase, "podIP": run.ip, "podIPs": [{"ip": run.ip}], "hostIP": "127.0.0.1",
                  "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready},
                                 {"type": "ContainersReady", "status": ready}],
                  "containerStatuses": [{"name": name, "ready": ready == "True", "restartCount": run.restarts,
                                         "image": run.pod["spec"]["containers"][0].get("image", ""),
                                         "state": state}]}  # fmt: skip
        key = json.dumps([phase, ready, run.restarts, run.exit_code])
        if key != run.reported:
            self.kube.patch("v1", "Pod", meta["namespace"], meta["name"], {"status": status}, "status")
            run.reported = key

    # -- one pod ---------------------------------------------------------------------------------
    def _volumes(self, run: Running) -> list[tuple[Path, str]]:
        """Write every volume's files under the pod's dir; (local dir, mount path) pairs."""
        pod, mounts = run.pod, []
        container = pod["spec"]["containers"][0]
        by_name = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            volume = by_name[mount["name"]]
            local = run.root / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self.kube.get("v1", "ConfigMap", pod["metadata"]["namespace"], volume["configMap"]["name"])
                for key, value in ((cm or {}).get("data") or {}).items():
                    self._write(run, local / key, value)
            elif "downwardAPI" in volume:
                for item in volume["downwardAPI"]["items"]:
                    self._write(run, local / item["path"], field_value(pod, item["fieldRef"]["fieldPath"], run.ip))
            mounts.append((local, mount["mountPath"]))
        return mounts

    def _write(self, run: Running, path: Path, text: str) -> None:
        if run.files.get(path) != text:  # in place: a bind-mounted file keeps its inode
            path.write_text(text)
            run.files[path] = text

    def start(self, run: Running) -> None:
        pod = run.pod
        container = pod["spec"]["containers"][0]
        env = {"PATH": f"{self.venv_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONUNBUFFERED": "1",
               "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"]}  # fmt: skip
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = field_value(pod, item["valueFrom"]["fieldRef"]["fieldPath"], run.ip)
            elif "secretKeyRef" in (item.get("valueFrom") or {}):
                value = secret_value(self.kube, pod["metadata"]["namespace"], item["valueFrom"]["secretKeyRef"])
                if value is not None:
                    env[item["name"]] = value
        role = (pod["metadata"].get("labels") or {}).get(LABEL_ROLE)
        if role in self.faults:
            env[ENV_FAULT_INJECTION] = self.faults[role]
        argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
        termination = run.root / "termination-log"
        termination.write_text("")
        target = container.get("terminationMessagePath") or "/dev/termination-log"
        binds = [*self._volumes(run), *self.image_dirs, (self.hosts, "/etc/hosts"), (termination, target)]
        workdir = shlex.quote(container.get("workingDir") or "/")
        script = " && ".join([*mount_commands(binds, self.image_paths), f"cd {workdir}", 'exec "$@"'])
        log = open(run.root / "container.log", "ab")  # the child process keeps it open
        run.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                                     "sh", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd="/")  # fmt: skip
        run.started = run.ready = False

    def _try_start(self, run: Running) -> None:
        try:
            self.start(run)
        except ContainerConfigError as err:
            print(f"kubelet: {run.pod['metadata']['name']}: CreateContainerConfigError: {err}", file=sys.stderr,
                  flush=True)  # fmt: skip

    def probe(self, run: Running) -> None:
        container = run.pod["spec"]["containers"][0]
        probe = container.get("readinessProbe") or container.get("startupProbe")
        if probe is None or "httpGet" not in probe:
            run.ready = True  # no probe: ready once running
            return
        get = probe["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
        try:
            with urllib.request.urlopen(f"http://{run.ip}:{port}{get.get('path', '/')}", timeout=2) as resp:
                run.ready = 200 <= resp.status < 400
        except OSError:
            run.ready = False

    def stop(self, run: Running) -> None:
        """SIGTERM to every process of the pod, SIGKILL to what is left after the grace period. The
        whole tree, as a container runtime's cgroup holds it: a torchrun worker runs in a session of
        its own, which a process-group signal would miss."""
        if run.proc is None:
            return
        tree = process_tree(run.proc.pid)
        signal_all(tree, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline and any(alive(pid) for pid in tree):
            run.proc.poll()  # reap the direct child
            time.sleep(0.1)
        signal_all([pid for pid in tree if alive(pid)], signal.SIGKILL)
        run.proc.wait()

    # -- the loop --------------------------------------------------------------------------------
    def sync_deployments(self, pods: list[Manifest]) -> None:
        for deployment in self.kube.list("apps/v1", "Deployment", None, {}):
            if deployment["metadata"].get("deletionTimestamp"):
                continue
            create, delete = deployment_pods(deployment, pods)
            for pod in create:
                self.kube.create(pod)
            for name in delete:
                self.kube.delete("v1", "Pod", deployment["metadata"]["namespace"], name)

    def sync_once(self) -> None:
        self.sync_deployments(self.kube.list("v1", "Pod", None, {}))
        self.services = self.kube.list("v1", "Service", None, {})
        pods = self.kube.list("v1", "Pod", None, {})
        for pod in pods:
            if not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                meta = pod["metadata"]
                self.kube.patch("v1", "Pod", meta["namespace"], meta["name"], {"spec": {"nodeName": self.node}})
                pod["spec"]["nodeName"] = self.node
        mine = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods
                if p["spec"].get("nodeName") == self.node}  # fmt: skip
        for key in [k for k in self.pods if k not in mine or mine[k]["metadata"].get("deletionTimestamp")]:
            self.stop(self.pods.pop(key))
        for key, pod in mine.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            run = self.pods.get(key)
            if run is not None and run.pod["metadata"].get("uid") != pod["metadata"].get("uid"):
                self.stop(run)  # deleted and recreated under the same name between two syncs
                run = None
            if run is None:
                root = self.workdir / "pods" / f"{key[0]}_{key[1]}_{pod['metadata'].get('uid', '')[:8]}"
                root.mkdir(parents=True, exist_ok=True)
                run = self.pods[key] = Running(pod, f"127.0.100.{self.next_ip}", root)
                self.next_ip += 1
                self._write_hosts()
                self._try_start(run)
            run.pod = pod
            self._volumes(run)  # refresh downward-API files (labels arrive after scheduling)
            self._advance(run)
            self.report(run)
        self._write_hosts()  # Services follow the pods they select

    def _advance(self, run: Running) -> None:
        if run.terminal:
            return
        if run.proc is None:  # its container config could not be resolved yet
            self._try_start(run)
            return
        code = run.proc.poll()
        if code is None:
            self.probe(run)
            return
        policy = run.pod["spec"].get("restartPolicy", "Always")
        run.exit_code = code
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            run.restarts += 1
            self.start(run)
        else:
            run.terminal = "Succeeded" if code == 0 else "Failed"

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{run.ip} {' '.join(dns_names(run.pod))}" for run in self.pods.values() if dns_names(run.pod)]
        for svc in self.services:
            meta = svc["metadata"]
            target = next((run for run in self.pods.values() if not run.terminal and run.proc is not None
                           and selects(svc["spec"].get("selector") or {}, run.pod["metadata"].get("labels"))), None)
            if target is not None:
                name, ns = meta["name"], meta["namespace"]
                lines.append(f"{target.ip} {name} {name}.{ns} {name}.{ns}.svc {name}.{ns}.svc.cluster.local")
        text = "\n".join(lines) + "\n"
        if not self.hosts.exists() or self.hosts.read_text() != text:
            self.hosts.write_text(text)

    def run_forever(self, interval: float = 0.5) -> None:
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.register_node()
        self._write_hosts()
        try:
            while not stopping:
                try:
                    self.sync_once()
                except Exception as err:  # the API server restarting must not kill the node
                    print(f"kubelet: sync failed: {err}", file=sys.stderr, flush=True)
                time.sleep(interval)
        finally:
            for run in self.pods.values():
                self.stop(run)


class BlockingKube:
    """The operator's async client for this synchronous loop: each call runs on a loop of its own."""

    def __init__(self, kube: Any):
        self._kube, self._loop = kube, asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._kube, name)
        return lambda *args, **kwargs: self._loop.run_until_complete(method(*args, **kwargs))


def main() -> None:
    import kopf

    from kuberl_operator.kube import PLURALS, Kube, login

    PLURALS.setdefault("Secret", "secrets")  # a kubelet reads Secrets for env; the operator never does

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", default="e2e-node")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--fault-injection", action="append", default=[], metavar="ROLE=VALUE",
                        help="KUBERL_FAULT_INJECTION=VALUE for the pods of ROLE (repeatable)")
    args = parser.parse_args()
    faults = dict(item.split("=", 1) for item in args.fault_injection)
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ["KUBECONFIG"] = args.kubeconfig  # where kopf's login reads it
    settings = kopf.OperatorSettings()
    kube = BlockingKube(Kube(lambda: login(settings)))
    Kubelet(kube, args.node, args.workdir, Path(sys.executable).parent, faults).run_forever()


if __name__ == "__main__":
    main()
