"""The operator restarted beside running experiments (an upgrade, a drained node): its informers list
every watched kind before the first sync (``kuberl_operator.handlers._inform``), so no sync sees an
experiment without its pods — nothing is written, no status flaps. (What was deleted while no watch
was open: ``test_informer``.)"""

from __future__ import annotations

import kopf
import pytest

from kuberl_operator.kube import FIRST_PAGE, Kube

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator, set_pod
from .kube_emulator import Fault
from .test_operator import experiment, get_rlx, quiet_requests

pytestmark = pytest.mark.integration
WRITES = ("create", "patch", "update", "delete")


@pytest.mark.slow
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


async def test_the_start_up_list_reads_pages_that_fit_a_byte_budget_one_at_a_time(tmp_path):
    """40 ConfigMaps of 64 KiB, a 256 KiB budget: the first page asks for FIRST_PAGE objects (their size
    unknown), every later one for as many as the budget holds at the sizes seen (3)."""
    async with emulated_cluster(tmp_path) as cluster:
        for i in range(40):
            await cluster.api.create("", "configmaps", "team-a", {"metadata": {"name": f"cm-{i:02d}"},
                                                                  "data": {"blob": "x" * (64 << 10)}})
        kube = Kube(lambda: kopf.ConnectionInfo(server=cluster.url, token="t"))
        try:
            pages = [page async for page, _ in kube.list_pages("v1", "ConfigMap", None, None, budget=256 << 10)]
            items = [obj for page in pages for obj in page]
        finally:
            await kube.close()
        assert sorted(obj["metadata"]["name"] for obj in items) == [f"cm-{i:02d}" for i in range(40)]
        assert {(obj["apiVersion"], obj["kind"]) for obj in items} == {("v1", "ConfigMap")}
        assert [len(page) for page in pages] == [FIRST_PAGE] + [3] * 12
        assert cluster.api.requests["list"] == len(pages)


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
