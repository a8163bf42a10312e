"""The operator's informers (``kuberl_operator.informer``): pages bounded by bytes, watch lines of any
length, what a list says is gone, a 410, a kind not served yet — and, through the real operator,
objects that sit idle for several resyncs stay held."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import kopf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api.contract import LABEL_JOB, LABEL_ROLE
from kuberl_operator.cache import ObjectCache
from kuberl_operator.informer import Informer, vanished
from kuberl_operator.kube import LIST_PAGE, PAGE_BYTES, Kube, next_page_size, watch_lines
from kuberl_operator.watches import JOBS, PODS, PYTORCHJOBS, ROOT_KINDS

from .harness import GROUP, emulated_cluster, eventually, pods, running_experiment, running_operator
from .kube_emulator import Fault
from .test_operator import experiment


@pytest.mark.parametrize(("answer_bytes", "items", "asked"), [(0, 0, LIST_PAGE), (8 << 20, 8, 8),
                                                              (100, 10, LIST_PAGE), (64 << 20, 2, 1)])
def test_a_page_asks_for_as_many_objects_as_the_budget_holds_at_the_sizes_seen(answer_bytes, items, asked):
    assert next_page_size(answer_bytes, items, budget=8 << 20) == asked


@given(st.lists(st.binary(max_size=300).filter(lambda b: b"\n" not in b), max_size=6),
       st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=10))
def test_watch_lines_are_the_events_however_the_stream_is_cut(lines, cuts):
    stream = b"".join(line + b"\n" for line in lines)
    chunks, at = [], 0
    for n in itertools.cycle(cuts):
        if at >= len(stream):
            break
        chunks.append(stream[at:at + n])
        at += n

    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        return [line async for line in watch_lines(source())]

    assert asyncio.run(collect()) == [line for line in lines if line.strip()]


def pod(name: str, version: str | None, namespace: str = "team-a") -> dict:
    meta = {"name": name, "namespace": namespace, **({"resourceVersion": version} if version else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def test_a_list_says_gone_what_it_lacks_unless_written_after_it_began():
    held = [pod("listed", "5"), pod("gone", "7"), pod("newer", "12"), pod("unversioned", None)]
    listed = {("Pod", "team-a", "listed")}
    assert [p["metadata"]["name"] for p in vanished(held, listed, "10")] == ["gone"]
    assert vanished(held, listed, "not-a-number") == []


class Seen:
    """What an informer handed over, in order: (name, live)."""

    def __init__(self, cache: ObjectCache | None = None) -> None:
        self.events: list[tuple[str, bool]] = []
        self.cache = cache if cache is not None else ObjectCache()

    async def handle(self, obj: dict, live: bool) -> None:
        self.events.append((obj["metadata"]["name"], live))
        if live:
            self.cache.observe(obj)
        else:
            self.cache.forget(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])

    def held(self, kind: str, namespace: str | None) -> list[dict]:
        return self.cache.held(kind)


async def new_pod(api, name: str, refs: list | None = None, notes: int = 0) -> dict:
    meta = {"name": name, "labels": {LABEL_ROLE: "trainer"}, "ownerReferences": refs or [],
            **({"annotations": {"notes": "x" * notes}} if notes else {})}
    return await api.create("", "pods", "team-a", {"metadata": meta,
                                                   "spec": {"containers": [{"name": "main", "image": "i"}]}})


@contextlib.asynccontextmanager
async def informing(cluster, watched, seen: Seen, resync: int = 300):
    kube = Kube(lambda: kopf.ConnectionInfo(server=cluster.url, token="t"))
    informer = Informer(kube, watched, None, seen.handle, seen.held, resync)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.listed.wait(), 10)
        yield informer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()


@pytest.mark.integration
async def test_what_was_deleted_while_no_informer_watched_is_gone_after_the_next_list(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        for name in ("a", "b", "c"):
            await new_pod(api, name)
        seen = Seen()
        async with informing(cluster, PODS, seen):
            pass
        await api.delete("", "pods", "team-a", "b")
        await new_pod(api, "d")
        seen.events.clear()
        async with informing(cluster, PODS, seen):
            pass
        assert seen.events == [("a", True), ("c", True), ("d", True), ("b", False)]
        assert seen.cache.get("Pod", "team-a", "b") is None


@pytest.mark.integration
async def test_after_a_410_the_informer_lists_again_and_misses_nothing(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        fault = Fault("WATCH", "pods", 410)
        api.faults.append(fault)
        seen = Seen()
        async with informing(cluster, PODS, seen) as informer:
            await eventually(lambda: fault.hits == 1 and informer.lists == 2, what="a second list after the 410")
            await new_pod(api, "late")
            await eventually(lambda: ("late", True) in seen.events, what="the pod created after it")
            await api.delete("", "pods", "team-a", "late")
            await eventually(lambda: ("late", False) in seen.events, what="its deletion")


@pytest.mark.integration
@pytest.mark.slow
async def test_the_watch_ends_every_resync_and_every_object_is_delivered_again(tmp_path):
    async with emulated_cluster(tmp_path) as cluster:
        await new_pod(cluster.api, "idle")
        seen = Seen()
        async with informing(cluster, PODS, seen, resync=1) as informer:
            await eventually(lambda: informer.lists >= 3, timeout=10, what="three lists")
        assert seen.events.count(("idle", True)) >= 3


@pytest.mark.integration
@pytest.mark.slow
async def test_a_kind_not_served_yet_is_watched_once_its_crd_appears(tmp_path):
    """No PyTorchJob CRD (Kubeflow not installed): the informer's list gets 404, it says so and tries
    again every resync; the kind served, its objects arrive."""
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        fault = Fault("LIST", "pytorchjobs", 404, times=2)
        api.faults.append(fault)
        seen = Seen()
        async with informing(cluster, PYTORCHJOBS, seen, resync=1) as informer:
            assert informer.lists == 0
            await api.create("kubeflow.org", "pytorchjobs", "team-a", {"metadata": {"name": "pj",
                                                                                   "labels": {LABEL_JOB: "j"}}})
            await eventually(lambda: ("pj", True) in seen.events, timeout=10, what="the PyTorchJob")
        assert fault.hits == 2


@pytest.mark.integration
@pytest.mark.slow
async def test_look_alikes_of_a_megabyte_come_a_few_per_page_and_none_is_held(tmp_path):
    """30 pods with a 1 MiB annotation and the operator's role label, none controlled by anything held:
    listed in pages of about ``PAGE_BYTES`` (4 MiB: 3 or 4 of them a page, so 30 MiB take 8 to 11
    lists, not 1); the cache holds only the job's own pod."""
    async with emulated_cluster(tmp_path) as cluster:
        api = cluster.api
        job = await api.create(GROUP, "trainerjobs", "team-a", {"metadata": {"name": "job"}, "spec": {}})
        owner = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "TrainerJob", "name": "job",
                 "uid": job["metadata"]["uid"], "controller": True}
        await new_pod(api, "job-0", [owner])
        for i in range(30):
            await new_pod(api, f"look-alike-{i:02d}", notes=1 << 20)
        cache = ObjectCache(roots=ROOT_KINDS)
        seen = Seen(cache)
        async with informing(cluster, JOBS, seen), informing(cluster, PODS, seen):
            pass
        assert [name for name, _ in seen.events].count("job-0") == 1 and len(seen.events) == 32
        assert [p["metadata"]["name"] for p in cache.held("Pod")] == ["job-0"] and cache.refused == 30
        pod_lists = api.requests["list"] - 1  # the job's list
        assert 30 * (1 << 20) // PAGE_BYTES <= pod_lists <= 11, pod_lists


@pytest.mark.integration
@pytest.mark.slow
async def test_objects_idle_for_several_resyncs_stay_held_and_are_still_reconciled(tmp_path, monkeypatch):
    """Resync every second; the experiment Running, nothing changes for 4.5 s (over two cache
    lifetimes of two resyncs). Then the trainer pod is deleted: the operator still knows its
    TrainerJob and makes it again. (With kopf's watches, which resume without a re-list, the idle
    TrainerJob had aged out of the cache and nothing came back.)"""
    monkeypatch.setenv("KUBERL_RESYNC_SECONDS", "1")
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await running_experiment(api, experiment(), pod_count=2)
        await asyncio.sleep(4.5)
        [trainer] = pods(api, "team-a", f"{LABEL_ROLE}=trainer")
        await api.delete("", "pods", "team-a", trainer["metadata"]["name"])
        await eventually(lambda: len(pods(api, "team-a", f"{LABEL_ROLE}=trainer")) == 1, timeout=10,
                         what="the trainer pod made again")
