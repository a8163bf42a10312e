"""``spec.trainer.lora``: train a low-rank adapter instead of the whole policy.

Each targeted linear layer computes W x + (alpha / rank) · B A x with W frozen, A [rank, in] and
B [out, rank] trained (B starts at zero, so the adapted policy starts as the base). Only A and B are
trained, checkpointed and sent to the inference replicas; the base weights come from
``spec.model`` on every pod.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from .base import ApiModel, cel

ALL_LINEAR = "all-linear"
MODULE_NAME = r"^[A-Za-z0-9_.-]+$"
ModuleName = Annotated[str, Field(min_length=1, max_length=64, pattern=MODULE_NAME)]


class LoraSpec(ApiModel):
    """A low-rank adapter trained on the frozen policy."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel((f"!('{ALL_LINEAR}' in self.targetModules) || size(self.targetModules) == 1",
                                  f"lora.targetModules: '{ALL_LINEAR}' names every linear layer; give it alone"))
    }
    rank: int = Field(ge=1, le=1024, description="r: the adapter's inner dimension")
    alpha: float | None = Field(None, gt=0, description="the update is scaled by alpha ÷ rank (default 2 × rank: "
                                                        "a scale of 2 whatever the rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training (0: the "
                                                        "trainer's log-probs are those the engine sampled from)")
    target_modules: list[ModuleName] = Field(
        [ALL_LINEAR], min_length=1, max_length=64, json_schema_extra={"x-kubernetes-list-type": "set"},
        description="linear layers to adapt, by the last part of their module name (e.g. q_proj, up_proj), or "
                    f"{ALL_LINEAR!r} (the default) for every linear layer but the output layer: attention and MLP "
                    "alike, as RL with LoRA wants it (the MLP layers matter most)")
    export_merged: bool = Field(True, description="spec.export also writes the policy with the adapter merged "
                                                  "into its weights (beside the adapter in PEFT's format, adapter/)")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError("names a module twice")
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError(f"{ALL_LINEAR!r} names every linear layer; give it alone")
        return names

    @property
    def effective_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        """alpha ÷ rank, the factor on B A x."""
        return self.effective_alpha / self.rank
