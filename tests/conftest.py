"""Shared fixtures: the example manifests and a minimal valid RLExperiment document."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


MINIMAL: dict[str, Any] = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "RLExperiment",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {
        "model": {"path": "file:///models/tiny"},
        "dataset": {"path": "builtin:arithmetic"},
        "reward": {"function": "kuberl.rewards:exact_match"},
    },
}


@pytest.fixture
def minimal() -> dict[str, Any]:
    return copy.deepcopy(MINIMAL)
