"""spec.agent → the user's agent as a Deployment, and the gateway's Service in front of trainer rank 0.

The agent's pods carry the experiment's label (its NetworkPolicy lets them reach the gateway) and
get ``OPENAI_BASE_URL`` (the gateway Service's DNS name) and ``OPENAI_API_KEY`` (the experiment's
agent token, from its own Secret: the gateway accepts it, the inference pool does not). They run
non-root, without privilege escalation or a service-account token, with a writable ``/tmp`` only.
"""

from __future__ import annotations

from kuberl.api.agent import AgentSpec
from kuberl.api.contract import (
    ANNOTATION_TOKEN_VERSION,
    API_TOKEN_KEY,
    ENV_OPENAI_API_KEY,
    ENV_OPENAI_BASE_URL,
    GATEWAY_PORT,
    LABEL_EXPERIMENT,
    LABEL_ROLE,
    MANAGED_BY,
    ROLE_AGENT,
    agent_deployment_name,
    agent_token_secret_name,
    gateway_service_name,
    trainer_rank0_selector,
)

from .common import RUN_AS_USER, Manifest, child_metadata, secret_env, with_defaults

AGENT_REQUESTS = {"cpu": "500m", "memory": "512Mi"}
AGENT_MEMORY_LIMIT = "2Gi"
AGENT_SCRATCH = "1Gi"


def gateway_url(experiment: str, namespace: str | None) -> str:
    host = gateway_service_name(experiment) + (f".{namespace}.svc" if namespace else "")
    return f"http://{host}:{GATEWAY_PORT}/v1"


def gateway_service(parent: Manifest, experiment: str, runtime: str) -> Manifest:
    """A ClusterIP Service on trainer rank 0's gateway port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(parent, gateway_service_name(experiment), {LABEL_EXPERIMENT: experiment}),
        "spec": {"selector": trainer_rank0_selector(experiment, runtime),
                 "ports": [{"name": "gateway", "port": GATEWAY_PORT, "targetPort": GATEWAY_PORT}]},
    }


def agent_resources(agent: AgentSpec) -> Manifest:
    """The user's requests/limits with the agent's defaults (``common.with_defaults``)."""
    requests, limits = with_defaults(agent.resources, AGENT_REQUESTS, AGENT_MEMORY_LIMIT)
    return {"requests": requests, "limits": limits}


def agent_env(agent: AgentSpec, experiment: str, namespace: str | None) -> list[Manifest]:
    own = [{"name": ENV_OPENAI_BASE_URL, "value": gateway_url(experiment, namespace)},
           secret_env(ENV_OPENAI_API_KEY, agent_token_secret_name(experiment), API_TOKEN_KEY)]
    return own + [var.to_wire() for var in agent.env]


def agent_deployment(parent: Manifest, experiment: str, agent: AgentSpec, image: str, running: bool,
                     token_version: str = "") -> Manifest:
    """``agent.replicas`` pods (none unless ``running``: a suspended or finished experiment's agent stops);
    a new ``token_version`` (its token Secret recreated) rolls them."""
    namespace = parent["metadata"].get("namespace")
    labels = {LABEL_EXPERIMENT: experiment, LABEL_ROLE: ROLE_AGENT}
    container: Manifest = {
        "name": "agent",
        "image": agent.image or image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(agent.command),
        "env": agent_env(agent, experiment, namespace),
        "resources": agent_resources(agent),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "readOnlyRootFilesystem": True},
    }
    if agent.working_dir:
        container["workingDir"] = agent.working_dir
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": AGENT_SCRATCH}}],
    }
    template_meta: Manifest = {"labels": {**MANAGED_BY, **labels}}
    if token_version:
        template_meta["annotations"] = {ANNOTATION_TOKEN_VERSION: token_version}
    template = {"metadata": template_meta, "spec": pod_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(parent, agent_deployment_name(experiment), labels),
        "spec": {"replicas": agent.replicas if running else 0, "selector": {"matchLabels": labels},
                 "template": template},
    }


def build_agent_children(parent: Manifest, experiment: str, agent: AgentSpec, image: str, runtime: str,
                         running: bool = True, token_version: str = "") -> list[Manifest]:
    """The agent Deployment and the gateway Service (``image``: the trainer's, the default)."""
    return [gateway_service(parent, experiment, runtime),
            agent_deployment(parent, experiment, agent, image, running, token_version)]
