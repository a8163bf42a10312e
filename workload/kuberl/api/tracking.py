"""Where a run's curves go besides TensorBoard (``spec.logging``): Weights & Biases and MLflow, both
off by default. Trainer rank 0 sends them the same scalars as TensorBoard, the run's spec as its
config, and each export's URI (``kuberl.trainer.trackers``). Credentials only by reference: the
operator hands them to the trainer pods as ``secretKeyRef`` env, which the libraries read themselves."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from .base import DNS1123_SUBDOMAIN, ApiModel, SecretKeyRef

Name = Annotated[str, Field(pattern=r"^[\w.@/ -]+$", min_length=1, max_length=128)]
HTTP_URL = r"^https?://[^\s/]+(/[^\s]*)?$"


class WandbMode(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


class WandbSpec(ApiModel):
    """Weights & Biases: the run's curves, config and export URI."""

    project: Name = Field(description="the W&B project")
    entity: Name | None = Field(None, description="team or user; default: the API key's default entity")
    name: Name | None = Field(None, description="the run's name; default: the experiment's name")
    group: Name | None = Field(None, description="W&B run group (e.g. a sweep's runs together)")
    tags: list[Name] = Field(default_factory=list, max_length=16, description="W&B run tags")
    base_url: str | None = Field(None, pattern=HTTP_URL, max_length=512,
                                 description="a self-hosted W&B server (WANDB_BASE_URL); wandb.ai if unset")
    api_key_secret: SecretKeyRef | None = Field(
        None, description="a Secret key holding the W&B API key, given to the trainer as WANDB_API_KEY by "
                          "secretKeyRef only")
    mode: WandbMode = Field(
        WandbMode.ONLINE, description="offline: the run is written beside the TensorBoard events (and copied "
                                      "with them next to the checkpoints), for `wandb sync` later")


class MlflowSpec(ApiModel):
    """MLflow: the run's metrics, parameters and export URI."""

    tracking_uri: str = Field(pattern=r"^(https?://[^\s/]+(/[^\s]*)?|file://.+|databricks(://\S*)?)$",
                              max_length=512, description="the MLflow tracking server, e.g. http://mlflow.mlops:5000")
    experiment: Name | None = Field(None, description="the MLflow experiment; default: kuberl")
    run_name: Name | None = Field(None, description="default: the experiment's name")
    credentials_secret: str | None = Field(
        None, pattern=DNS1123_SUBDOMAIN, max_length=253,
        description="a Secret with any of MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD, given to the trainer only as secretKeyRef env")


class LoggingSpec(ApiModel):
    """Dashboards besides TensorBoard. A tracker that cannot reach its server warns once, and training
    goes on: trackers are fed from a queue on their own thread, never from the training step."""

    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None
