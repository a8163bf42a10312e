"""What reaches pod specs from a manifest: Kubernetes quantities, label keys and values, image references,
absolute paths, resources and tolerations — bounded like the Kubernetes fields they fill."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, WithJsonSchema

from .base import ApiModel, shown

ABSOLUTE_PATH = r"^/[A-Za-z0-9._/-]*$"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[KMGTPE]i?|m)?$")


def _quantity(value: object) -> str:
    """A Kubernetes quantity such as 2, "500m" or "16Gi", kept as a string."""
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _QUANTITY.match(text):
        raise ValueError(f"{shown(value)} is not a Kubernetes quantity (e.g. 2, 500m, 16Gi)")
    return text


Quantity = Annotated[
    str, BeforeValidator(_quantity), WithJsonSchema({"x-kubernetes-int-or-string": True})
]
# Free text that reaches pod specs: bounded like the Kubernetes fields it fills.
LabelKey = Annotated[str, Field(min_length=1, max_length=317)]  # prefix (253) + "/" + name (63)
LabelValue = Annotated[str, Field(max_length=63)]
ResourceName = Annotated[str, Field(min_length=1, max_length=253)]
ImageRef = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")]


class ResourceRequirements(ApiModel):
    """A container's compute resources, as in a pod spec."""

    requests: dict[ResourceName, Quantity] | None = Field(
        None, max_length=16, description='what the scheduler reserves, e.g. cpu: "4", memory: 32Gi')
    limits: dict[ResourceName, Quantity] | None = Field(
        None, max_length=16, description="the most the container may use (over its memory limit it is killed)")


class Toleration(ApiModel):
    """A taint the pods tolerate, as in a pod spec."""

    key: LabelKey | None = Field(None, description="the taint's key (empty with operator Exists: every taint)")
    operator: Annotated[str, Field(pattern="^(Exists|Equal)$")] | None = Field(
        None, description="Equal (default: the value must match) or Exists")
    value: LabelValue | None = Field(None, description="the taint's value (operator Equal)")
    effect: Annotated[str, Field(pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")] | None = Field(
        None, description="the taint effect to tolerate (empty: all)")
    toleration_seconds: int | None = Field(None, ge=0, le=10**9, description="NoExecute: how long a pod stays after "
                                                                             "the taint appears")
