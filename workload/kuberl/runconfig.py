"""The run config every workload process reads: the ConfigMap the operator renders, or the file
`kuberl run` writes — ``{"experiment": name, "namespace": ns, "spec": {...}}``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from .api.spec import RLExperimentSpec


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    spec: RLExperimentSpec


def load_run_config(path: str | Path) -> RunConfig:
    doc = yaml.safe_load(Path(path).read_text())
    return RunConfig(experiment=doc.get("experiment", "local"), spec=RLExperimentSpec.model_validate(doc["spec"]))


def write_run_config(path: Path, experiment: str, spec: RLExperimentSpec) -> Path:
    path.write_text(yaml.safe_dump({"experiment": experiment, "spec": spec.to_wire()}, sort_keys=False))
    return path
