"""Shared pydantic base: camelCase on the wire, unknown fields rejected, CEL rules attached."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Positive = Annotated[int, Field(ge=1)]

API_GROUP = "kuberl.io"
API_VERSION = "v1alpha1"
GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class ApiModel(BaseModel):
    """Base of every API object: fields are snake_case in Python, camelCase in YAML."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as it is stored in Kubernetes (no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretKeyRef(ApiModel):
    """One key of a Secret in the experiment's namespace, handed to pods only as ``secretKeyRef`` env."""

    name: str = Field(pattern=DNS1123_SUBDOMAIN, max_length=253, description="the Secret's name")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253, description="the key in the Secret")


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """JSON-schema extra holding CEL rules as (expression, message) pairs for the CRD."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


def shown(value: Any) -> str:
    """A value for an error message: scalars as they are (cut short), containers by type only."""
    if isinstance(value, list | dict):
        return type(value).__name__
    try:
        return repr(value)[:40]
    except ValueError:  # an int beyond sys.get_int_max_str_digits
        return "an integer too large to print"
