"""What a workload process takes from outside the spec, resolved once at its entry point and passed down.

Two sources, with one precedence rule (``resolve``):
- the pod's environment, which the operator's builders write and ``kuberl run`` imitates: the
  pod's IP, the API tokens, torchrun's rendezvous, the p2p exchange's address, the S3 endpoint,
  the pod-info labels file, threads;
- the run config's ``settings`` section, which only ``kuberl run`` writes: where a local run keeps
  its checkpoints, curves, weights and summary, its ports, its replicas' URLs, its step limit and
  the cores of trainer rank 0's rollout process.
A value in the run config's section wins over the environment, which wins over the default. Leaf
modules never read the environment; they get what they need from a ``Settings``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .api.contract import (
    ENV_AGENT_TOKEN,
    ENV_API_TOKEN,
    ENV_CACHE_DIR,
    ENV_CHECKPOINT_KEY,
    ENV_EXCHANGE_ADDR,
    ENV_EXCHANGE_PORT,
    ENV_FAULT_INJECTION,
    ENV_HUB_ENDPOINT,
    ENV_HUB_TOKEN,
    ENV_INFERENCE_SERVICE,
    ENV_PODINFO_LABELS,
    ENV_PORT,
    ENV_REPLICA,
    ENV_REPLICA_HOST,
    ENV_REPLICA_HOSTS,
    ENV_REPLICA_LEADER,
    ENV_S3_ENDPOINT,
    ENV_TERMINATION_LOG,
    ENV_THREADS,
    GATEWAY_PORT,
    INFERENCE_PORT,
    MASTER_PORT,
    PODINFO_LABELS,
    PROGRESS_PORT,
    TERMINATION_LOG,
)


@dataclass(frozen=True)
class Settings:
    """One process's settings (see the module docstring for where each comes from)."""

    # from the pod's environment
    bind_host: str = ""  # POD_IP: the address servers and stores bind ("": every address)
    node_name: str = ""  # NODE_NAME: this rank's node when its pod labels do not say
    threads: int = 1
    local_rank: int = 0  # torchrun's LOCAL_RANK
    master_addr: str = "127.0.0.1"  # torchrun's MASTER_ADDR / MASTER_PORT: trainer rank 0
    master_port: int = MASTER_PORT
    exchange_addr: str = ""  # the p2p exchange store's host as inference pods know it ("": master_addr)
    exchange_port: int = 0  # its port (0: master_port + 1)
    replica: int = 0  # this inference replica's index
    replica_host: int = 0  # this process's rank within its replica (0: the leader, which serves HTTP)
    replica_hosts: int = 1  # the processes (hosts) the replica spans
    replica_leader: str = ""  # host:port where they meet ("": a one-process replica)
    inference_port: int = INFERENCE_PORT
    inference_service: str = ""  # the pool's headless Service ("": ``<experiment>-inference``)
    podinfo_labels: Path = Path(PODINFO_LABELS)
    s3_endpoint: str | None = None
    cache_dir: Path = Path("/tmp/kuberl-cache")
    termination_log: Path = Path(TERMINATION_LOG)
    api_token: str = field(default="", repr=False)
    agent_token: str = field(default="", repr=False)
    hub_token: str = field(default="", repr=False)  # hf:// models and datasets (spec.storage.hubTokenSecret)
    checkpoint_key: str = field(default="", repr=False)  # signs checkpoint manifests ("": unsigned, unchecked)
    hub_endpoint: str | None = None  # spec.storage.hubEndpoint; None: huggingface.co
    fault_injection: str = ""  # a replica takes injected faults (kuberl.inference.faults); never set on clusters
    # from the run config's settings section (kuberl run), else these defaults
    checkpoint_uri: str | None = None  # None: spec.checkpoint.uri
    max_steps: int | None = None  # None: spec.algorithm.maxSteps
    tensorboard_dir: Path | None = None  # None: next to the checkpoints
    staging_dir: Path = Path("/tmp/kuberl-staging")
    weights_dir: Path | None = None  # disk exchange's directory; None: spec.weightSync.directory
    summary_path: Path | None = None
    prompts_log: Path | None = None  # one JSON line per trained step: {"step", "prompts", "reward"}; None: none
    progress_port: int = PROGRESS_PORT
    gateway_port: int = GATEWAY_PORT
    inference_urls: tuple[str, ...] = ()  # the replicas' URLs; (): the pool's DNS names
    replicas_file: Path | None = None  # kuberl run: a JSON list of the replicas' URLs, rewritten by kuberl scale
    rollout_cores: tuple[int, ...] = ()  # kuberl run: the cores rank 0's rollout process runs on; (): the trainer's
    trace_file: Path | None = None  # kuberl run with spec.observability: sampled spans, one JSON line each

    def checkpoint_location(self, spec_uri: str | None) -> str | None:
        """Where checkpoints (and the published curves) go: the run config's (a local run's work dir),
        else ``spec.checkpoint.uri``."""
        return self.checkpoint_uri or spec_uri

    @property
    def exchange_address(self) -> tuple[str, int]:
        """Where the p2p exchange group's store listens: trainer rank 0, ``master_port`` + 1."""
        return self.exchange_addr or self.master_addr, self.exchange_port or self.master_port + 1


DEFAULTS = Settings()  # a bare process: nothing set (tests, tools)

RUN_CONFIG_FIELDS = ("checkpoint_uri", "max_steps", "tensorboard_dir", "staging_dir", "weights_dir", "summary_path",
                     "prompts_log", "progress_port", "gateway_port", "inference_urls", "replicas_file", "rollout_cores",
                     "trace_file")

_FROM_ENV = {"bind_host": "POD_IP", "node_name": "NODE_NAME", "threads": ENV_THREADS, "local_rank": "LOCAL_RANK",
             "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "exchange_addr": ENV_EXCHANGE_ADDR,
             "exchange_port": ENV_EXCHANGE_PORT, "replica": ENV_REPLICA, "inference_port": ENV_PORT,
             "replica_host": ENV_REPLICA_HOST, "replica_hosts": ENV_REPLICA_HOSTS, "replica_leader": ENV_REPLICA_LEADER,
             "inference_service": ENV_INFERENCE_SERVICE, "podinfo_labels": ENV_PODINFO_LABELS,
             "s3_endpoint": ENV_S3_ENDPOINT, "cache_dir": ENV_CACHE_DIR, "termination_log": ENV_TERMINATION_LOG,
             "api_token": ENV_API_TOKEN, "agent_token": ENV_AGENT_TOKEN, "hub_token": ENV_HUB_TOKEN,
             "hub_endpoint": ENV_HUB_ENDPOINT, "fault_injection": ENV_FAULT_INJECTION,
             "checkpoint_key": ENV_CHECKPOINT_KEY}


def _typed(name: str, value: Any) -> Any:
    """``value`` (env text or run-config YAML) as field ``name``'s declared type (``Path | None`` →
    Path, ``tuple[str, ...]`` and ``tuple[int, ...]`` from comma-separated text); ValueError naming the field."""
    kind = str({f.name: f for f in fields(Settings)}[name].type).removesuffix(" | None")
    try:
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else value
            return tuple(int(x) for x in items) if kind == "tuple[int, ...]" else tuple(items)
        if kind == "int":
            return int(value)
        if kind == "Path":
            return Path(value)
        return str(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"setting {name}: {value!r} is not valid ({err})") from err


def resolve(env: Mapping[str, str], run_config: Mapping[str, Any] | None = None) -> Settings:
    """The precedence rule: ``run_config`` (the run config's ``settings`` section, snake_case names)
    over ``env`` (empty values count as unset) over the defaults. Unknown names in ``run_config``
    are refused, naming them."""
    unknown = set(run_config or {}) - set(RUN_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"run config settings: unknown {sorted(unknown)}; allowed {list(RUN_CONFIG_FIELDS)}")
    values = {name: _typed(name, env[var]) for name, var in _FROM_ENV.items() if env.get(var)}
    values.update({name: _typed(name, value) for name, value in (run_config or {}).items() if value is not None})
    return replace(Settings(), **values)


def from_environment(run_config: Mapping[str, Any] | None = None) -> Settings:
    """``resolve`` over this process's environment: for entry points only."""
    return resolve(os.environ, run_config)


def inherited_environment() -> dict[str, str]:
    """This process's whole environment: what the processes ``kuberl run`` starts inherit."""
    return dict(os.environ)


def run_config_section(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The run config's ``settings`` section as ``kuberl run`` writes it (paths as text, None left out)."""
    section = {}
    for name, value in settings.items():
        if name not in RUN_CONFIG_FIELDS:
            raise ValueError(f"{name} is not a run config setting; allowed {list(RUN_CONFIG_FIELDS)}")
        if value is not None:
            section[name] = list(value) if isinstance(value, tuple | list) else \
                str(value) if isinstance(value, Path) else value
    return section


def hub_token(settings: Settings) -> str | bool | None:
    """The credential ``huggingface_hub`` may send: the one the run was given (``spec.storage.hubTokenSecret``
    → HF_TOKEN); else, for huggingface.co only, this machine's saved login (None: the library's own
    lookup); never an implicit one to a mirror a manifest names (False: no token at all)."""
    if settings.hub_token:
        return settings.hub_token
    return None if settings.hub_endpoint is None else False


def environment_without(names: Collection[str]) -> dict[str, str]:
    """This process's environment less ``names``: for a child that must not hold them (a reward worker
    runs the user's code on model-written text; it gets none of KubeRL's own secrets)."""
    return {name: value for name, value in os.environ.items() if name not in names}
