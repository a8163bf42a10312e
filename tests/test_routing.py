"""Which sync an event or a write calls for (``kuberl_operator.routing``)."""

from __future__ import annotations

from kuberl_operator.routing import follow_ups, parent_experiment, pod_owner, syncs_for


def child(kind: str, name: str, experiment: str | None, owner: str | None) -> dict:
    refs = [{"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "name": owner, "controller": True}]
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "ownerReferences": refs if owner else []},
            "spec": {"experiment": experiment} if experiment else {}}


def test_an_experiments_writes_call_for_its_new_pool_and_job_but_not_for_itself():
    synced = ("RLExperiment", "ns", "exp")
    written = [("Secret", "ns", "exp-api-token"), ("ConfigMap", "ns", "exp-config"),
               ("InferencePool", "ns", "exp-inference"), ("TrainerJob", "ns", "exp-trainer"),
               ("NetworkPolicy", "ns", "exp"), ("RLExperiment", "ns", "exp"), ("InferencePool", "ns", "exp-inference")]
    assert follow_ups(synced, written, lambda *key: None) == [("InferencePool", "ns", "exp-inference"),
                                                              ("TrainerJob", "ns", "exp-trainer")]


def test_a_childs_own_status_write_calls_for_its_experiments_roll_up_and_a_standalone_ones_does_not():
    held = {("InferencePool", "ns", "exp-inference"): child("InferencePool", "exp-inference", "exp", "exp"),
            ("TrainerJob", "ns", "solo"): child("TrainerJob", "solo", "exp", None)}  # names one, not its child
    pool = ("InferencePool", "ns", "exp-inference")
    assert follow_ups(pool, [("Service", "ns", "exp-inference"), pool], lambda *k: held.get(k)) == [
        ("RLExperiment", "ns", "exp")]
    assert follow_ups(pool, [("Pod", "ns", "exp-inference-r0-h0")], lambda *k: held.get(k)) == []  # no status write
    solo = ("TrainerJob", "ns", "solo")
    assert follow_ups(solo, [solo], lambda *k: held.get(k)) == []
    assert parent_experiment(held[solo]) is None


def test_a_pod_belongs_to_its_pool_by_label_and_to_its_job_by_owner_or_label():
    def pod(labels: dict[str, str], owner: str | None = None) -> dict:
        refs = [{"apiVersion": "kuberl.io/v1alpha1", "kind": "TrainerJob", "name": owner}] if owner else []
        return {"metadata": {"name": "p", "labels": labels, "ownerReferences": refs}}

    assert pod_owner(pod({"kuberl.io/inference-pool": "exp-inference"})) == ("InferencePool", "exp-inference")
    assert pod_owner(pod({}, owner="exp-trainer")) == ("TrainerJob", "exp-trainer")
    assert pod_owner(pod({"kuberl.io/trainer-job": "exp-trainer"})) == ("TrainerJob", "exp-trainer")  # a PyTorchJob's
    assert pod_owner(pod({"app": "other"})) is None


def test_someone_elses_change_calls_for_the_owners_sync_and_a_deletion_not_for_the_deleted_one():
    pool = child("InferencePool", "exp-inference", "exp", "exp")
    assert syncs_for(pool, live=True) == [("InferencePool", "ns", "exp-inference"), ("RLExperiment", "ns", "exp")]
    assert syncs_for(pool, live=False) == [("RLExperiment", "ns", "exp")]
    assert syncs_for(child("TrainerJob", "solo", "exp", None), live=True) == [("TrainerJob", "ns", "solo")]
    assert syncs_for({"kind": "RLExperiment", "metadata": {"name": "exp", "namespace": "ns"}}, live=False) == []
    service = child("Service", "exp-inference", None, "exp")
    assert syncs_for(service, live=False) == [("RLExperiment", "ns", "exp")]
    foreign = {**service, "metadata": {**service["metadata"], "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "controller": True}]}}
    assert syncs_for(foreign, live=True) == []
    pytorchjob = {"kind": "PyTorchJob", "metadata": {"name": "j", "namespace": "ns",
                                                     "labels": {"kuberl.io/trainer-job": "exp-trainer"}}}
    assert syncs_for(pytorchjob, live=False) == [("TrainerJob", "ns", "exp-trainer")]
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns",
                                       "labels": {"kuberl.io/inference-pool": "exp-inference"}}}
    assert syncs_for(pod, live=True) == [("InferencePool", "ns", "exp-inference")]
