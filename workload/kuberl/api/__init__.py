"""KubeRL API: pure pydantic models of the custom resources (no torch, no kubernetes imports)."""

from .allocation import Allocation, AllocationError, Dims, parse_allocation
from .base import API_GROUP, API_VERSION, GROUP_VERSION
from .progress import Progress
from .resolve import EXTENDED_RESOURCE, FieldIssue, InferencePlan, TrainerPlan, resolve
from .resources import (
    KINDS,
    Condition,
    InferencePool,
    InferencePoolSpec,
    InferencePoolStatus,
    Phase,
    Resource,
    RLExperiment,
    RLExperimentStatus,
    TrainerJob,
    TrainerJobSpec,
    TrainerJobStatus,
)
from .spec import Accelerator, Backend, Engine, RLExperimentSpec
from .validation import validate_document

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "EXTENDED_RESOURCE",
    "GROUP_VERSION",
    "KINDS",
    "Accelerator",
    "Allocation",
    "AllocationError",
    "Backend",
    "Condition",
    "Dims",
    "Engine",
    "FieldIssue",
    "InferencePlan",
    "InferencePool",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "Phase",
    "Progress",
    "RLExperiment",
    "RLExperimentSpec",
    "RLExperimentStatus",
    "Resource",
    "TrainerJob",
    "TrainerJobSpec",
    "TrainerJobStatus",
    "TrainerPlan",
    "parse_allocation",
    "resolve",
    "validate_document",
]
