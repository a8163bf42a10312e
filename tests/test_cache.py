"""The operator's in-memory view of what its watches delivered (``kuberl_operator.cache``): newest
version wins, the label index answers selectors, the operator's own status writes come back as
echoes that trigger nothing, and an object no watch delivered for too long counts as gone."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kuberl_operator.cache import ObjectCache


def pod(name: str, rv: int, **labels: str) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "team-a", "resourceVersion": str(rv),
                                        "labels": labels}}


def test_the_newest_version_wins_and_an_older_one_is_ignored():
    cache = ObjectCache()
    assert not cache.observe(pod("a", 5, role="trainer"), quiet=True)  # the operator's label patch: nothing new
    # the watch's late event of the version before it (a kubelet's change the patch sits on): still
    # news — nothing reconciled it yet — but the held object stays the newer one
    assert cache.observe(pod("a", 4, role="inference"))
    assert cache.get("Pod", "team-a", "a")["metadata"]["resourceVersion"] == "5"
    assert cache.list("Pod", "team-a", {"role": "inference"}) == []


def test_an_echo_of_a_status_write_is_not_news_but_a_create_or_someone_elses_change_is():
    now = [0.0]
    cache = ObjectCache(clock=lambda: now[0], refresh=100)
    cache.observe(pod("a", 7), quiet=True)  # the operator's own status write
    assert not cache.observe(pod("a", 7))  # its watch echo: nothing to reconcile
    assert cache.observe(pod("a", 8))  # someone else's change
    cache.observe(pod("b", 3))  # not the operator's write (a watch delivered it): its redelivery is news
    assert cache.observe(pod("b", 3))
    cache.observe(pod("c", 9), quiet=True)
    now[0] = 150.0
    assert cache.observe(pod("c", 9))  # a resync's re-list after `refresh`: the safety net re-syncs


def test_late_echoes_of_own_writes_are_not_news_but_someone_elses_older_change_is():
    """Two status writes in a row: the watch brings the first one's echo after the cache holds the
    second. It stays the held version and triggers nothing; a change in between that the operator
    did not make (a kubelet's) is news even when it arrives after the operator's newer write."""
    cache = ObjectCache()
    cache.observe(pod("a", 10, role="trainer"), quiet=True)
    cache.observe(pod("a", 12, role="trainer"), quiet=True)
    assert not cache.observe(pod("a", 10, role="trainer"))  # late echo of the first write
    assert cache.get("Pod", "team-a", "a")["metadata"]["resourceVersion"] == "12"
    assert cache.observe(pod("a", 11, role="inference"))  # someone else's, between the two
    assert not cache.observe(pod("a", 12, role="trainer"))
    with cache.creating(pod("b", 0)):  # the watch event of a create before the create's answer
        assert not cache.observe(pod("b", 20))
    assert cache.get("Pod", "team-a", "b") is not None and cache.observe(pod("b", 21))


def test_an_object_no_watch_delivered_for_max_age_counts_as_gone():
    now = [0.0]
    cache = ObjectCache(max_age=600, clock=lambda: now[0])
    cache.observe(pod("a", 1, role="trainer"))
    now[0] = 599.0
    assert cache.get("Pod", "team-a", "a") is not None
    now[0] = 601.0  # deleted while no watch was open: no DELETED event ever came
    assert cache.get("Pod", "team-a", "a") is None and cache.list("Pod", "team-a", {"role": "trainer"}) == []


def test_a_caller_cannot_change_what_the_cache_holds():
    cache = ObjectCache()
    cache.observe(pod("a", 1, role="trainer"))
    held = cache.get("Pod", "team-a", "a")
    held["metadata"]["labels"]["role"] = "changed"
    assert cache.get("Pod", "team-a", "a")["metadata"]["labels"] == {"role": "trainer"}


labels = st.dictionaries(st.sampled_from(["role", "job", "pool"]), st.sampled_from(["x", "y"]), max_size=3)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), labels, st.booleans()), max_size=30), labels)
def test_a_selector_lists_exactly_what_a_scan_would(events, selector):
    """The label index, after any sequence of observations and deletions, against a plain scan."""
    cache, truth, rv = ObjectCache(), {}, 0
    for name, obj_labels, deleted in events:
        rv += 1
        if deleted:
            cache.forget("Pod", "team-a", name)
            truth.pop(name, None)
        else:
            cache.observe(pod(name, rv, **obj_labels))
            truth[name] = obj_labels
    expected = sorted(n for n, lab in truth.items() if all(lab.get(k) == v for k, v in selector.items()))
    assert [p["metadata"]["name"] for p in cache.list("Pod", "team-a", selector)] == expected


def test_a_pod_is_held_without_its_spec_but_its_node_and_nothing_is_held_twice():
    cache = ObjectCache()
    big = pod("a", 1, role="trainer")
    big["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]
    big["spec"] = {"nodeName": "node-7", "containers": [{"name": "c", "env": [{"name": "X", "value": "y" * 10000}]}]}
    big["status"] = {"phase": "Running"}
    cache.observe(big)
    held = cache.get("Pod", "team-a", "a")
    assert held["spec"] == {"nodeName": "node-7"} and held["status"] == {"phase": "Running"}
    assert "managedFields" not in held["metadata"] and big["spec"]["containers"]  # the caller's is untouched


def test_an_experiment_is_only_rolled_up_while_its_last_full_sync_converged():
    """``handlers.Convergence``: a roll-up alone only after a full sync converged a generation; any
    request for more, or a sync that converged nothing (invalid, a name taken, a failure), makes the
    next one full."""
    from kuberl_operator.handlers import Convergence

    key = ("RLExperiment", "team-a", "a")
    state = Convergence()
    assert state.take(key) == (False, None)  # never converged: roll_up_experiment goes full itself
    state.ask_full(key)
    assert state.take(key) == (True, None)
    state.record(key, 3)
    assert state.take(key) == (False, 3)  # a child's status write: the roll-up alone
    state.ask_full(key)  # e.g. the spec changed meanwhile
    assert state.take(key) == (True, None)
    state.record(key, None)  # that full sync found the spec invalid
    assert state.take(key) == (True, None)
    state.record(key, 4)
    state.forget(key)  # deleted
    assert state.take(key) == (False, None)


def test_a_deleted_object_is_held_as_terminating_until_its_watch_says_it_is_gone():
    """The operator's delete marks the held object terminating (a sync does not count it as a live
    child), though no new version came; the watch's echo of that same version does not undo it."""
    cache = ObjectCache()
    cache.observe(pod("a", 3, role="trainer"))
    cache.mark_terminating("Pod", "team-a", "a")
    assert cache.get("Pod", "team-a", "a")["metadata"]["deletionTimestamp"]
    cache.observe(pod("a", 3, role="trainer"))  # a late re-delivery of the version held
    assert cache.get("Pod", "team-a", "a")["metadata"]["deletionTimestamp"]
    assert [p["metadata"]["name"] for p in cache.list("Pod", "team-a", {"role": "trainer"})] == ["a"]
    cache.forget("Pod", "team-a", "a")
    assert cache.get("Pod", "team-a", "a") is None


def test_the_progress_poller_reads_running_experiments_and_rank0s_ip_from_the_cache():
    from kuberl_operator.handlers import running_targets, trainer_pod_ip

    now = [0.0]
    cache = ObjectCache(clock=lambda: now[0], max_age=100)

    def experiment(name: str, phase: str, runtime: str = "native") -> dict:
        return {"kind": "RLExperiment", "metadata": {"name": name, "namespace": "team-a", "resourceVersion": "1"},
                "spec": {"trainer": {"runtime": runtime}}, "status": {"phase": phase, "progress": {"step": 3}}}

    cache.observe(experiment("a", "Running"))
    cache.observe(experiment("b", "Pending"))
    cache.observe(experiment("c", "Running", "kubeflow"))
    cache.observe({**pod("a-trainer-n0", 2, **{"kuberl.io/role": "trainer"}), "status": {"podIP": "10.0.0.7"}})
    cache.observe({**pod("a-inference-r0-h0", 2, **{"kuberl.io/role": "inference"}), "status": {"podIP": "10.0.0.8"}})
    targets = sorted(running_targets(cache), key=lambda t: t.name)
    assert [(t.name, t.runtime, t.progress) for t in targets] == [("a", "native", {"step": 3}),
                                                                  ("c", "kubeflow", {"step": 3})]
    assert trainer_pod_ip(cache, "team-a", "a-trainer-n0") == "10.0.0.7"
    assert trainer_pod_ip(cache, "team-a", "a-inference-r0-h0") is None  # not a trainer's
    assert trainer_pod_ip(cache, "team-a", "missing") is None
    now[0] = 150.0  # not delivered again for longer than max_age: gone, not polled
    assert running_targets(cache) == []


def owned(kind: str, name: str, uid: str, owner_uid: str | None, rv: int = 1, controller: bool = True) -> dict:
    meta: dict = {"name": name, "namespace": "team-a", "uid": uid, "resourceVersion": str(rv),
                  "labels": {"app.kubernetes.io/managed-by": "kuberl-operator"}}
    if owner_uid is not None:
        meta["ownerReferences"] = [{"kind": "X", "name": "x", "uid": owner_uid, "controller": controller}]
    return {"kind": kind, "metadata": meta}


def test_only_what_the_operator_controls_is_held_and_a_look_alike_costs_nothing():
    """Roots are held; a child only when its controller is held (through a PyTorchJob too) or the
    operator wrote it; a look-alike with the operator's labels is refused and, once its controller is
    gone or changed, so is a child held before."""
    cache = ObjectCache(roots={"RLExperiment", "TrainerJob"})
    cache.observe(owned("TrainerJob", "job", "u-job", None))
    cache.observe(owned("PyTorchJob", "job-trainer", "u-ptj", "u-job"))
    cache.observe(owned("Pod", "job-trainer-master-0", "u-pod", "u-ptj"))  # Kubeflow's pod: held through its job
    assert cache.get("Pod", "team-a", "job-trainer-master-0") is not None
    for look_alike in (owned("ConfigMap", "theirs", "u-1", None), owned("Pod", "theirs", "u-2", "u-unknown"),
                       owned("Pod", "not-controller", "u-3", "u-job", controller=False)):
        assert not cache.observe(look_alike)
        assert cache.get(look_alike["kind"], "team-a", look_alike["metadata"]["name"]) is None
    assert cache.refused == 3
    assert cache.list("Pod", "team-a", {"app.kubernetes.io/managed-by": "kuberl-operator"}) == [
        cache.get("Pod", "team-a", "job-trainer-master-0")]
    cache.observe(owned("Service", "no-owner", "u-svc", None), quiet=True)  # the operator's own write
    cache.observe(owned("Service", "no-owner", "u-svc", None, rv=2))  # its watch event later: still ours
    assert cache.get("Service", "team-a", "no-owner")["metadata"]["resourceVersion"] == "2"
    cache.forget("PyTorchJob", "team-a", "job-trainer")
    cache.observe(owned("Pod", "job-trainer-master-0", "u-pod", "u-ptj", rv=2))  # its controller is gone
    assert cache.get("Pod", "team-a", "job-trainer-master-0") is None
    assert len(cache) == 2  # the TrainerJob and the Service


def test_a_kind_of_the_same_name_from_another_api_group_is_never_held_nor_evicts_ours():
    """The key names a kind: Gateway API's InferencePool (inference.networking.x-k8s.io) beside ours
    must neither be held in our pool's place nor, deleted, take ours out."""
    from kuberl_operator.watches import CACHED_GROUPS, ROOT_KINDS

    cache = ObjectCache(roots=ROOT_KINDS, groups=CACHED_GROUPS)

    def pool(api_version: str, uid: str) -> dict:
        return {"apiVersion": api_version, "kind": "InferencePool",
                "metadata": {"name": "exp-inference", "namespace": "team-a", "uid": uid, "resourceVersion": "9"}}

    ours = pool("kuberl.io/v1alpha1", "u-ours")
    assert cache.observe(ours)
    assert not cache.observe(pool("inference.networking.x-k8s.io/v1", "u-gateway"))
    assert cache.get("InferencePool", "team-a", "exp-inference")["metadata"]["uid"] == "u-ours"
    assert not cache.of_our_group(pool("inference.networking.x-k8s.io/v1", "u-gateway"))  # its deletion is ignored
    assert cache.of_our_group(ours) and cache.refused == 1
    owner = [{"uid": "u-ours", "controller": True}]
    replica = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "namespace": "team-a", "uid": "u-p", "ownerReferences": owner}}
    assert cache.observe(replica)  # the core group: ""
