"""Per-client numbers of the Tinker front door, for Prometheus (``GET /metrics``, open like every server's):
what each client asked for and how much work it got, and what it holds now.

    kuberl_tinker_requests_total{client, kind}   requests accepted, by kind (forward_backward, optim_step, …)
    kuberl_tinker_tokens_total{client, kind}     tokens through forward/backward ("trained"), sampled ("sampled")
    kuberl_tinker_failures_total{client, category}   futures that failed: "user" (the request) or "server"
    kuberl_tinker_queued{client}                 training work waiting (the round-robin's queue)
    kuberl_tinker_models{client} / _samplers{client} / _sessions{client}   held now
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TinkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kuberl_tinker_requests", "requests accepted", ["client", "kind"],
                                registry=self.registry)
        self.tokens = Counter("kuberl_tinker_tokens", "tokens trained on or sampled", ["client", "kind"],
                              registry=self.registry)
        self.failures = Counter("kuberl_tinker_failures", "futures that failed", ["client", "category"],
                                registry=self.registry)
        self.queued = Gauge("kuberl_tinker_queued", "training work waiting", ["client"], registry=self.registry)
        self.models = Gauge("kuberl_tinker_models", "training models held", ["client"], registry=self.registry)
        self.samplers = Gauge("kuberl_tinker_samplers", "live samplers", ["client"], registry=self.registry)
        self.sessions = Gauge("kuberl_tinker_sessions", "open sessions", ["client"], registry=self.registry)
