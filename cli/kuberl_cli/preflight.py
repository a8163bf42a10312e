"""What ``kuberl validate`` checks on this machine beyond the manifest itself (the operator cannot: it
has neither the files nor the user's code): a local dataset file's columns, whether the reward
functions and the workflow exist, and what the model's architecture refuses of the spec (routing replay
without experts, a Megatron layout its layers or experts do not split over, LoRA targets it lacks; read
from its config alone: :mod:`kuberl.trainer.model_fit`). A missing column or a refused field is an error,
and so is a user module here that does not define the name the spec gives; a module that is not here at
all is a warning, since it may live only in the user's image; so is a tracker (``spec.logging``) whose
library is not installed here, and an ``hf://`` model whose config cannot be fetched from here (offline,
gated). An ``s3://`` model's config, or a path that is
not a directory here (a volume in the pods), is read where the run starts: the trainer checks it then."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kuberl.api import FieldIssue, RLExperiment
from kuberl.api.resolve import cluster_warnings
from kuberl.api.rewards import in_kuberl_package
from kuberl.api.sources import DatasetSource
from kuberl.api.spec import RLExperimentSpec
from kuberl.api.validation import standalone_sections


def experiment_spec(doc: Any) -> RLExperimentSpec | None:
    """The spec of a document that parses as an RLExperiment (whatever its cross-field issues), else None."""
    if not isinstance(doc, dict) or doc.get("kind") != RLExperiment.model_fields["kind"].default:
        return None
    try:
        return RLExperiment.model_validate(doc).spec
    except ValidationError:
        return None


def data_preflight(doc: dict[str, Any]) -> list[FieldIssue]:
    """For an RLExperiment whose schema failed elsewhere: the local data checks of each dataset section that
    parses on its own (``spec.dataset``, ``spec.evaluation.dataset``), so that one ``kuberl validate``
    says everything."""
    try:
        from kuberl.data.tables import local_file_issues
    except ImportError:  # an operator-only install: the full preflight says so once the schema is right
        return []
    return [FieldIssue(path, message) for field, source in standalone_sections(doc, "dataset", DatasetSource)
            for path, message in local_file_issues(source, field)]


def preflight(spec: RLExperimentSpec, architecture: bool = True, import_rewards: bool = False
              ) -> tuple[list[FieldIssue], list[FieldIssue]]:
    """(errors, warnings) for ``spec`` on this machine; ([], [a warning]) without the workload extra.
    ``architecture``: also what the model's config refuses (:func:`model_checks`: it imports torch and
    may ask the hub — with none of this machine's credentials when the manifest names the hub's
    address; ``kuberl render`` leaves it out). ``import_rewards``: import the reward modules (running
    their code) to check the function too; else only their files are looked for."""
    try:
        from kuberl.data.tables import local_file_issues
    except ImportError as err:  # an operator-only install: nothing to check the files with
        return [], [FieldIssue("spec", f"local checks skipped: the workload packages are not installed ({err})")]
    sources = [("spec.dataset", spec.dataset)]
    if spec.evaluation is not None and spec.evaluation.dataset is not None:
        sources.append(("spec.evaluation.dataset", spec.evaluation.dataset))
    errors = [FieldIssue(path, message)
              for field, source in sources for path, message in local_file_issues(source, field)]
    code_errors, code_warnings = user_code_checks(spec, import_rewards)
    model_errors, model_warnings = model_checks(spec) if architecture else ([], [])
    return (errors + code_errors + model_errors,
            code_warnings + tracker_warnings(spec) + model_warnings + cluster_warnings(spec))


def user_code_checks(spec: RLExperimentSpec, import_it: bool) -> tuple[list[FieldIssue], list[FieldIssue]]:
    """(errors, warnings) for the user code the spec names (reward functions, the workflow): a module
    not on this machine's path is a warning (it may be in the image only), one that lacks the name an
    error (:func:`kuberl.imports.lookup_issue`). Names in KubeRL's package: the manifest's own checks."""
    from kuberl.imports import lookup_issue

    named = [("spec.reward.function", spec.reward.function), ("spec.rollout.workflow", spec.rollout.workflow)]
    if spec.evaluation is not None and spec.evaluation.reward is not None:
        named.append(("spec.evaluation.reward.function", spec.evaluation.reward.function))
    errors, warnings = [], []
    for field, path in named:
        if path is None or in_kuberl_package(path):
            continue
        error, warning = lookup_issue(path, field, import_it)
        if error:
            errors.append(FieldIssue(field, error.removeprefix(field + " ")))
        if warning:
            warnings.append(FieldIssue(field, f"{warning.removeprefix(field + ' ')} (fine if it is in your image; "
                                              "the trainer imports it at start-up)"))
    return errors, warnings


def model_checks(spec: RLExperimentSpec) -> tuple[list[FieldIssue], list[FieldIssue]]:
    """(errors, warnings): what the model's architecture refuses of ``spec``, when its config can be read
    here; a warning saying why not otherwise."""
    from dataclasses import replace

    from kuberl.models.loading import ModelLoadError, model_shape
    from kuberl.settings import from_environment
    from kuberl.trainer.model_fit import model_issues

    settings = from_environment()
    if spec.storage.hub_endpoint:  # the manifest's mirror gets none of this machine's credentials
        settings = replace(settings, hub_endpoint=spec.storage.hub_endpoint, hub_token="")
    skipped = "model checks skipped ({}); the trainer checks the model at start-up"
    try:
        shape = model_shape(spec.model, settings)
    except ModelLoadError as err:
        if spec.model.path.startswith("hf://"):  # offline here, or a gated model without a token
            return [], [FieldIssue("spec.model.path", skipped.format(err))]
        return [FieldIssue("spec.model.path", str(err).removeprefix("spec.model.path "))], []
    except (OSError, ValueError) as err:  # a directory without a readable config.json
        return [FieldIssue("spec.model.path", f"{spec.model.path!r}: its config cannot be read: {err}")], []
    return ([] if shape is None else model_issues(spec, shape)), []  # None: read where the run starts


TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}  # spec.logging's trackers → the module each needs


def tracker_warnings(spec: RLExperimentSpec) -> list[FieldIssue]:
    """A tracker ``spec.logging`` names whose library this machine lacks: ``kuberl run`` here would
    start without it (warned, training goes on); the workload images carry both."""
    import importlib.util

    return [FieldIssue(f"spec.logging.{name}", f"{module} is not installed here (pip install 'kuberl[tracking]'); "
                                               "kuberl run would train without it; the workload images have it")
            for name, module in TRACKER_MODULES.items()
            if getattr(spec.logging, name) is not None and importlib.util.find_spec(module) is None]
