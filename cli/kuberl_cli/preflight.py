"""What ``kuberl validate`` checks on this machine beyond the manifest itself (the operator cannot: it
has neither the files nor the user's code): a local dataset file's columns, and whether the reward
function imports. A missing column is an error; a reward module that does not import here is a
warning, since it may live only in the user's image; so is a tracker (``spec.logging``) whose library
is not installed here."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kuberl.api import FieldIssue, RLExperiment
from kuberl.api.rewards import KUBERL_REWARDS_MODULE
from kuberl.api.spec import RLExperimentSpec


def experiment_spec(doc: Any) -> RLExperimentSpec | None:
    """The spec of a document that parses as an RLExperiment (whatever its cross-field issues), else None."""
    if not isinstance(doc, dict) or doc.get("kind") != RLExperiment.model_fields["kind"].default:
        return None
    try:
        return RLExperiment.model_validate(doc).spec
    except ValidationError:
        return None


def preflight(spec: RLExperimentSpec) -> tuple[list[FieldIssue], list[FieldIssue]]:
    """(errors, warnings) for ``spec`` on this machine; ([], [a warning]) without the workload extra."""
    try:
        from kuberl.data.tables import local_file_issues
        from kuberl.rewards import import_warning
    except ImportError as err:  # an operator-only install: nothing to check the files with
        return [], [FieldIssue("spec", f"local checks skipped: the workload packages are not installed ({err})")]
    sources = [("spec.dataset", spec.dataset)]
    rewards = [("spec.reward.function", spec.reward.function)]
    if spec.evaluation is not None:
        if spec.evaluation.dataset is not None:
            sources.append(("spec.evaluation.dataset", spec.evaluation.dataset))
        if spec.evaluation.reward is not None:
            rewards.append(("spec.evaluation.reward.function", spec.evaluation.reward.function))
    errors = [FieldIssue(path, message)
              for field, source in sources for path, message in local_file_issues(source, field)]
    warnings = [FieldIssue(field, f"{message.removeprefix(field + ' ')} (fine if it is in your image; the trainer "
                                  "imports it at start-up)")
                for field, function in rewards
                if not function.startswith(f"{KUBERL_REWARDS_MODULE}:")  # the manifest's own check names those
                and (message := import_warning(function, field))]
    return errors, warnings + tracker_warnings(spec)


TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}  # spec.logging's trackers → the module each needs


def tracker_warnings(spec: RLExperimentSpec) -> list[FieldIssue]:
    """A tracker ``spec.logging`` names whose library this machine lacks: ``kuberl run`` here would
    start without it (warned, training goes on); the workload images carry both."""
    import importlib.util

    return [FieldIssue(f"spec.logging.{name}", f"{module} is not installed here (pip install 'kuberl[tracking]'); "
                                               "kuberl run would train without it; the workload images have it")
            for name, module in TRACKER_MODULES.items()
            if getattr(spec.logging, name) is not None and importlib.util.find_spec(module) is None]
