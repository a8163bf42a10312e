"""The ArgoCD health checks, executed as ArgoCD does (Lua, with the object as ``obj``) via lupa,
for every phase of every kind; and the shipped argocd-cm snippet is what `kuberl argocd` renders."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lupa import LuaRuntime

from kuberl_operator.argocd import argocd_cm_snippet

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = ROOT / "deploy/argocd/argocd-cm-health.yaml"
KINDS = ("RLExperiment", "TrainerJob", "InferencePool")


def scripts() -> dict[str, str]:
    data = yaml.safe_load(SNIPPET.read_text())["data"]
    return {key.rsplit("_", 1)[1]: script for key, script in data.items()}


def health(kind: str, status: dict | None, generation: int = 2) -> tuple[str, str]:
    obj = {"apiVersion": "kuberl.io/v1alpha1", "kind": kind, "metadata": {"name": "x", "generation": generation}}
    if status is not None:
        obj["status"] = status
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(scripts()[kind])
    return result["status"], result["message"]


def cond(kind: str, status: str, reason: str = "R", message: str = "m") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def test_snippet_is_up_to_date():
    assert SNIPPET.read_text() == argocd_cm_snippet(), "run `kuberl argocd` to regenerate"
    assert set(scripts()) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_waits_for_the_operator(kind):
    assert health(kind, None) == ("Progressing", "Waiting for the KubeRL operator")
    stale = {"phase": "Failed", "observedGeneration": 1}  # the verdict on an older spec does not count
    assert health(kind, stale) == ("Progressing", "Waiting for the operator to observe generation 2")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("phase", "expected"), [("Pending", "Progressing"), ("Initializing", "Progressing"),
                                                 ("Suspended", "Suspended"), ("Failed", "Degraded")])
def test_phases_shared_by_all_kinds(kind, phase, expected):
    status = {"phase": phase, "observedGeneration": 2,
              "conditions": [cond("Degraded", "True", "CrashLoopBackOff", "trainer-n0 restarts")]}
    got, message = health(kind, status)
    assert got == expected
    if phase == "Failed":
        assert message == "CrashLoopBackOff: trainer-n0 restarts"


def test_running_is_progressing_for_jobs_and_healthy_for_the_pool():
    running = {"phase": "Running", "observedGeneration": 2, "progress": {"step": 7, "reward": 0.5}}
    assert health("RLExperiment", running) == ("Progressing", "Running: step 7, reward 0.5")
    assert health("TrainerJob", {"phase": "Running", "observedGeneration": 2}) == ("Progressing", "Running")
    assert health("InferencePool", {"phase": "Running", "observedGeneration": 2}) == ("Healthy", "Running")


def test_succeeded_degraded_and_invalid_spec():
    done = {"phase": "Succeeded", "observedGeneration": 2, "progress": {"step": 500, "reward": 0.78}}
    assert health("RLExperiment", done) == ("Healthy", "Succeeded: step 500, reward 0.78")
    degraded = {"phase": "Running", "observedGeneration": 2,
                "conditions": [cond("Ready", "True"), cond("Degraded", "True", "ImagePullBackOff", "bad image")]}
    assert health("RLExperiment", degraded) == ("Degraded", "ImagePullBackOff: bad image")
    recovered = {**degraded, "conditions": [cond("Degraded", "False")]}
    assert health("RLExperiment", recovered)[0] == "Progressing"
    invalid = {"phase": "Pending", "observedGeneration": 2,
               "conditions": [cond("SpecValid", "False", "InvalidSpec", "spec.trainer.nodes: must be ≥ 1")]}
    assert health("RLExperiment", invalid) == ("Degraded", "InvalidSpec: spec.trainer.nodes: must be ≥ 1")


def test_the_shipped_application_leaves_resizes_to_the_scale_subresource():
    """Autoscaling, `kubectl scale` and an HPA write the replicas through the scale subresource: the
    Application ignores exactly those fields (from the CRDs' specReplicasPath) and keeps them on sync
    (RespectIgnoreDifferences), so self-heal does not undo a resize; and it deploys where an operator
    installed as the README says watches."""
    from kuberl.api.crd import SCALE

    app = yaml.safe_load((ROOT / "deploy/argocd/application.yaml").read_text())["spec"]
    ignored = {(d["group"], d["kind"]): d["jsonPointers"] for d in app["ignoreDifferences"]}
    written = {("kuberl.io", kind): ["/" + scale["specReplicasPath"].lstrip(".").replace(".", "/")]
               for kind, scale in SCALE.items()}
    assert ignored == written
    sync = app["syncPolicy"]
    assert "RespectIgnoreDifferences=true" in sync["syncOptions"] and sync["automated"]["selfHeal"]
    readme = (ROOT / "README.md").read_text()
    assert f"watchNamespaces={{{app['destination']['namespace']}}}" in readme
