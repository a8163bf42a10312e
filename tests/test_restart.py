"""The operator restarted beside running experiments (an upgrade, a drained node): it lists every
watched kind before its first sync (``kuberl_operator.priming``), so no sync sees an experiment
without its pods — nothing is written, no status flaps — and what was deleted while it started is
forgotten and replaced."""

from __future__ import annotations

import kopf
import pytest

from kuberl.api.contract import LABEL_ROLE
from kuberl_operator.cache import ObjectCache
from kuberl_operator.kube import Kube
from kuberl_operator.priming import confirm, prime
from kuberl_operator.watches import ROOT_KINDS, WATCHED

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .kube_emulator import Fault
from .test_operator import experiment, get_rlx, quiet_requests

pytestmark = pytest.mark.integration
WRITES = ("create", "patch", "update", "delete")


async def test_a_restart_beside_running_experiments_writes_nothing_and_no_status_flaps(tmp_path):
    names = [f"run-{i}" for i in range(4)]
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        async with running_operator(cluster):
            for name in names:
                doc = experiment()
                doc["metadata"]["name"] = name
                await api.create(GROUP, "rlexperiments", "team-a", doc)
            await eventually(lambda: len(pods(api, "team-a")) == 2 * len(names), what="pods")
            for pod in pods(api, "team-a"):
                await set_pod(api, pod, "Running", ready=True)
            await eventually(lambda: all(get_rlx(api, n).get("status", {}).get("phase") == "Running" for n in names),
                             what="all Running")
            await quiet_requests(api)
        before, logged = dict(api.requests), len(api.log)
        async with running_operator(cluster):
            after = await quiet_requests(api)
        written = {verb: after.get(verb, 0) - before.get(verb, 0) for verb in WRITES
                   if after.get(verb, 0) != before.get(verb, 0)}
        changed = [(key[1], kind, obj["metadata"]["name"], (obj.get("status") or {}).get("phase"))
                   for _, key, kind, obj in api.log[logged:]]
        assert written == {} and changed == [], (written, changed)


async def test_what_was_deleted_between_the_start_up_list_and_the_watch_is_forgotten(tmp_path):
    """``prime`` holds what the list found, ``confirm`` forgets what no watch delivered since and the
    API server no longer has (nothing would ever report it gone), and keeps the rest."""
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        for name in ("a", "b", "c"):
            await api.create("", "pods", "team-a", {"metadata": {"name": name, "labels": {LABEL_ROLE: "trainer"}},
                                                    "spec": {"containers": [{"name": "main", "image": "i"}]}})
        await api.create("", "pods", "team-a", {"metadata": {"name": "theirs"},
                                                "spec": {"containers": [{"name": "main", "image": "i"}]}})
        kube = Kube(lambda: kopf.ConnectionInfo(server=cluster.url, token="t"))
        cache = ObjectCache()
        try:
            held = await prime(kube, cache, [None], WATCHED)
            assert held["Pod"] == 3  # not another tenant's
            assert [key[2] for key in cache.unconfirmed()] == ["a", "b", "c"]
            cache.observe(cache.get("Pod", "team-a", "a"))  # the watch delivered it: confirmed
            await api.delete("", "pods", "team-a", "b")  # gone before any watch delivered it
            gone = await confirm(kube, cache, [None], WATCHED)
        finally:
            await kube.close()
        assert [obj["metadata"]["name"] for obj in gone] == ["b"]
        assert cache.get("Pod", "team-a", "b") is None
        assert cache.get("Pod", "team-a", "c") is not None and cache.unconfirmed() == []


async def test_the_start_up_list_holds_only_what_the_operator_controls(tmp_path):
    """Listed with the operator's labels: a TrainerJob's pod (its controller listed first) is held, a
    look-alike with the same labels and no held controller is not, however large."""
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        job = await api.create(GROUP, "trainerjobs", "team-a", {"metadata": {"name": "job"}, "spec": {}})
        owner = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "TrainerJob", "name": "job",
                 "uid": job["metadata"]["uid"], "controller": True}
        theirs = await api.create("", "configmaps", "team-a", {"metadata": {"name": "theirs"}})
        for name, refs in (("job-0", [owner]), ("look-alike", [{**owner, "uid": theirs["metadata"]["uid"]}]),
                           ("no-owner", [])):
            await api.create("", "pods", "team-a", {
                "metadata": {"name": name, "labels": {LABEL_ROLE: "trainer"}, "ownerReferences": refs,
                             "annotations": {"notes": "x" * 100_000}},
                "spec": {"containers": [{"name": "main", "image": "i"}]}})
        kube = Kube(lambda: kopf.ConnectionInfo(server=cluster.url, token="t"))
        cache = ObjectCache(roots=ROOT_KINDS)
        try:
            held = await prime(kube, cache, [None], WATCHED)
        finally:
            await kube.close()
        assert held["Pod"] == 1 and held["TrainerJob"] == 1
        assert [key[2] for key in cache.unconfirmed()] == ["job-0", "job"]
        assert cache.get("Pod", "team-a", "look-alike") is None and cache.refused == 2


async def test_the_start_up_list_reads_every_page_one_at_a_time(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        for i in range(7):
            await cluster.api.create("", "configmaps", "team-a", {"metadata": {"name": f"cm-{i}"}})
        kube = Kube(lambda: kopf.ConnectionInfo(server=cluster.url, token="t"))
        try:
            pages = [page async for page in kube.list_pages("v1", "ConfigMap", None, None, page=2)]
            items = [obj for page in pages for obj in page]
        finally:
            await kube.close()
        assert sorted(obj["metadata"]["name"] for obj in items) == [f"cm-{i}" for i in range(7)]
        assert {(obj["apiVersion"], obj["kind"]) for obj in items} == {("v1", "ConfigMap")}
        assert [len(page) for page in pages] == [2, 2, 2, 1] and cluster.api.requests["list"] == 4


async def test_a_start_up_list_that_fails_does_not_stop_the_operator(tmp_path):
    """The API server answers 500 to the start-up list of pods: the operator says so and serves."""
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        fault = Fault("LIST", "pods", 500)
        api.faults.append(fault)
        async with running_operator(cluster):
            assert fault.hits == 1
            await api.create(GROUP, "rlexperiments", "team-a", experiment())
            await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
