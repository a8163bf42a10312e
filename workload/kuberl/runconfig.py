"""The run config every workload process reads: the ConfigMap the operator renders, or the file
`kuberl run` writes — ``{"experiment": name, "namespace": ns, "runId": id, "spec": {...}}``, and from
`kuberl run` a ``settings`` section (its directories, ports and step limit: ``kuberl.settings``).
``runId`` (the RLExperiment's UID; a per-work-dir id in local mode) marks the run's checkpoints:
a run never loads another run's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from .api.resolve import FieldIssue, InferencePlan, TrainerPlan, resolve
from .api.spec import RLExperimentSpec
from .settings import run_config_section


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    spec: RLExperimentSpec
    run_id: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)  # kuberl.settings.RUN_CONFIG_FIELDS
    source: Path | None = None  # the file it was read from (the trainer follows the pool's size in it)

    @cached_property
    def resolved(self) -> tuple[InferencePlan | None, TrainerPlan | None, list[FieldIssue]]:
        """``resolve(spec)``, once per run config: both pools' plans and the spec's cross-field issues."""
        return resolve(self.spec)

    @property
    def inference(self) -> InferencePlan:
        """The pool as resolved: engine, replicas and parallel degrees from the spec, the
        allocation string or the accelerator's defaults."""
        plan, _, issues = self.resolved
        if plan is None:
            raise ValueError("; ".join(map(str, issues)) or "no inference pool")
        return plan


def load_run_config(path: str | Path) -> RunConfig:
    doc = yaml.safe_load(Path(path).read_text())
    run_id = doc.get("runId")
    return RunConfig(experiment=doc.get("experiment", "local"), spec=RLExperimentSpec.model_validate(doc["spec"]),
                     run_id=str(run_id) if run_id else None, settings=doc.get("settings") or {}, source=Path(path))


def write_run_config(path: Path, experiment: str, spec: RLExperimentSpec, run_id: str | None = None,
                     settings: Mapping[str, Any] | None = None) -> Path:
    """The run config file; ``settings``: what ``kuberl run`` sets for every process (``kuberl.settings``)."""
    doc = {"experiment": experiment, **({"runId": run_id} if run_id else {}), "spec": spec.to_wire(),
           **({"settings": run_config_section(settings)} if settings else {})}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
