"""The user's agent (``spec.agent``): its pods' command, image, environment and resources."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from .base import ApiModel, SecretKeyRef, cel
from .pods import ABSOLUTE_PATH, ImageRef, ResourceRequirements

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESERVED_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY")  # set by KubeRL: the gateway and the experiment's token


class EnvSource(ApiModel):
    """Where an environment variable's value comes from: a Secret's key."""

    secret_key_ref: SecretKeyRef = Field(description="the Secret key (in the experiment's namespace)")


class EnvVar(ApiModel):
    """An environment variable of the agent: a value, or a key of a Secret (never written here)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel(("has(self.value) != has(self.valueFrom)", "give exactly one of value and valueFrom"))
    }
    name: str = Field(pattern=ENV_NAME, max_length=128, description="the variable's name (not KUBERL_* nor one KubeRL "
                                                                    "sets)")
    value: str | None = Field(None, max_length=4096, description="its value, in plain text")
    value_from: EnvSource | None = Field(None, description="its value from a Secret (for keys and tokens)")

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: give exactly one of value and valueFrom")
        if self.name in RESERVED_ENV or self.name.startswith("KUBERL_"):
            raise ValueError(f"env {self.name}: set by KubeRL ({', '.join(RESERVED_ENV)}, KUBERL_*)")
        return self


class AgentSpec(ApiModel):
    """The user's agent (``kuberl.gateway``): it talks to the policy through the experiment's
    OpenAI-compatible gateway (``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` are set for it) and ends each
    episode with a reward; its sessions are what the trainer trains on."""

    image: ImageRef | None = Field(None, description="default: the trainer's image")
    command: list[Annotated[str, Field(max_length=4096)]] = Field(
        min_length=1, max_length=64, description="the agent's command line (the container's command); it reads the "
                                                 "gateway's address and token from its environment")
    working_dir: str | None = Field(None, pattern=ABSOLUTE_PATH, max_length=256,
                                    description="the container's working directory (kuberl run: the manifest's "
                                                "directory)")
    replicas: int = Field(1, ge=1, le=256, description="agent pods (a Deployment)")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="the agent's own environment variables")
    resources: ResourceRequirements | None = Field(None, description="each agent pod's requests and limits")
    session_timeout_seconds: int = Field(600, ge=10, le=86400,
                                         description="an episode idle this long ends untrained")
