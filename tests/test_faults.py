"""Fault injection: the emulated API server answers 409, 422, 429 and 500, or does not answer, on
chosen requests. The operator retries each object with backoff, reports what will not heal by
itself (a Degraded condition and an Event naming the object and the reason), and converges once
the faults clear: every child exactly once, every one owned, nothing left after a delete."""

from __future__ import annotations

import time

import pytest

from .harness import GROUP, emulated_cluster, eventually, pods, running_operator
from .kube_emulator import Fault
from .test_operator import experiment, get_rlx

OWNED_KINDS = [("", "configmaps"), ("", "services"), ("", "pods"), ("", "secrets"),
               ("networking.k8s.io", "networkpolicies"), (GROUP, "inferencepools"), (GROUP, "trainerjobs")]


def objects_of(api, namespace: str) -> dict[str, list[dict]]:
    return {plural: [o for o in api.list(group, plural, namespace) if o["kind"] != "Event"]
            for group, plural in OWNED_KINDS}


def degraded_reasons_seen(api, plural: str, name: str) -> set[str]:
    """Every Degraded=True reason the object's status ever carried (the emulator keeps each version)."""
    reasons = set()
    for _, (_, p), _, obj in api.log:
        if p == plural and obj["metadata"]["name"] == name:
            for c in (obj.get("status") or {}).get("conditions") or []:
                if c.get("type") == "Degraded" and c.get("status") == "True":
                    reasons.add(c.get("reason"))
    return reasons


@pytest.mark.slow
@pytest.mark.integration
async def test_the_operator_converges_through_api_faults_without_duplicates_or_orphans(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERL_API_TIMEOUT_SECONDS", "1")
    monkeypatch.setenv("KUBERL_BACKOFF_BASE_SECONDS", "0.2")
    monkeypatch.setenv("KUBERL_BACKOFF_MAX_SECONDS", "2")
    faults = [
        Fault("POST", "configmaps", 422, times=3),  # will not heal by itself: Degraded + Event
        Fault("POST", "pods", 500, times=2),
        Fault("POST", "services", 429, times=1),  # Retry-After: 1
        Fault("PATCH", "inferencepools", 409, times=1, subresource="status"),
        Fault("POST", "secrets", 0, times=1, hang=3),  # no answer: the client's timeout fires
    ]
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        api.faults.extend(faults)
        started = time.monotonic()
        await api.create(GROUP, "rlexperiments", "team-a", experiment())

        def converged() -> bool:
            objs = objects_of(api, "team-a")
            status = get_rlx(api, "cpu-tiny").get("status") or {}
            degraded = [c for c in status.get("conditions") or [] if c["type"] == "Degraded"]
            children_reported = all((o.get("status") or {}).get("phase") for o in objs["inferencepools"]
                                    + objs["trainerjobs"])
            return (len(objs["pods"]) == 2 and all(len(objs[k]) == 1 for k in ("configmaps",
                    "networkpolicies", "inferencepools", "trainerjobs")) and len(objs["services"]) == 2
                    and len(objs["secrets"]) == 2  # the API token and the checkpoint key
                    and children_reported and all(f.hits == f.times for f in faults)
                    and status.get("phase") == "Pending" and degraded and degraded[0]["status"] == "False")

        await eventually(converged, timeout=60, what="convergence after the faults")
        seconds = time.monotonic() - started
        print(f"converged {seconds:.1f} s after creation through {sum(f.times for f in faults)} injected faults")

        assert "ApiError422" in degraded_reasons_seen(api, "rlexperiments", "cpu-tiny")
        events = [e for e in api.list("", "events", "team-a") if e.get("reason") == "ApiError422"]
        assert events and events[0]["involvedObject"]["name"] == "cpu-tiny"
        assert "configmaps" in events[0]["message"] or "422" in events[0]["message"]

        objs = objects_of(api, "team-a")
        uids = {o["metadata"]["uid"] for group, plural in OWNED_KINDS for o in api.list(group, plural, "team-a")}
        uids.add(get_rlx(api, "cpu-tiny")["metadata"]["uid"])
        for plural, items in objs.items():
            for obj in items:
                refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
                assert len(refs) == 1 and refs[0]["uid"] in uids, f"orphan {plural}/{obj['metadata']['name']}"

        await api.delete(GROUP, "rlexperiments", "team-a", "cpu-tiny")
        assert all(not items for items in objects_of(api, "team-a").values())


@pytest.mark.slow
@pytest.mark.integration
async def test_the_progress_poller_works_when_only_watched_namespaces_may_be_listed(tmp_path, monkeypatch):
    """watchNamespaces mode: the operator may not list experiments cluster-wide (403 here, as
    RBAC would answer); the poller reads its indices instead, so team-a's progress still arrives."""
    import socket

    from kuberl.api import Progress
    from kuberl.trainer.progress import ProgressServer

    from .harness import bind, set_pod

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ProgressServer(Progress(max_steps=100, phase="running", step=4, version=4, reward=0.5))
    runner = await server.start(port)
    monkeypatch.setenv("KUBERL_PROGRESS_URL", f"http://127.0.0.1:{port}/progress")
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "0.2")
    try:
        async with emulated_cluster(tmp_path) as cluster:
            api = cluster.api
            forbidden = Fault("LIST", "rlexperiments", 403, times=10**6, namespace="")
            api.faults.append(forbidden)
            async with running_operator(cluster, namespaces=["team-a"]):
                await api.create(GROUP, "rlexperiments", "team-a", experiment())
                await api.create(GROUP, "rlexperiments", "team-b", experiment(namespace="team-b"))
                await eventually(lambda: len(pods(api, "team-a")) == 2, what="team-a's pods")
                for pod in pods(api, "team-a"):
                    await bind(api, pod, "node-a")
                    await set_pod(api, pod, "Running", ready=True)
                await eventually(lambda: (get_rlx(api, "cpu-tiny").get("status") or {}).get("progress", {})
                                 .get("step") == 4, what="team-a's progress")
                assert pods(api, "team-b") == [] and not get_rlx(api, "cpu-tiny", "team-b").get("status")
            assert forbidden.hits == 0, "nothing listed experiments cluster-wide"
    finally:
        await runner.cleanup()


@pytest.mark.integration
async def test_a_401_logs_in_again_once_then_the_call_goes_through(tmp_path):
    """A rotated service-account token: the API server answers 401 to the old one. The client reads
    its credentials again and repeats the call, once; a second 401 is the caller's error."""
    import kopf

    from kuberl_operator.kube import ApiError, Kube

    async with emulated_cluster(tmp_path) as cluster:
        logins = []

        def credentials() -> kopf.ConnectionInfo:
            logins.append(len(logins))
            return kopf.ConnectionInfo(server=cluster.url, token=f"token-{len(logins)}")

        kube = Kube(credentials)
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "team-a"}}
        try:
            cluster.api.faults.append(Fault("POST", "configmaps", 401, times=1))
            created = await kube.create(cm)
            assert created["metadata"]["uid"] and len(logins) == 2
            assert cluster.api.get("", "configmaps", "team-a", "a")["metadata"]["uid"] == created["metadata"]["uid"]
            cluster.api.faults.append(Fault("POST", "configmaps", 401, times=2))
            try:
                await kube.create({**cm, "metadata": {"name": "b", "namespace": "team-a"}})
                raise AssertionError("a second 401 must be raised")
            except ApiError as err:
                assert err.status == 401
            assert len(logins) == 3 and cluster.api.list("", "configmaps", "team-a") == [created]
        finally:
            await kube.close()


@pytest.mark.slow
@pytest.mark.integration
async def test_a_transient_error_that_persists_is_reported_and_cleared_once_it_heals(tmp_path, monkeypatch):
    """The API server answers 500 to the ConfigMap's create 8 times in a row (a broken admission
    webhook): from the 6th failed sync on the experiment says so (Degraded, ApiError500, how many
    attempts) with an Event; once the create goes through, it converges and Degraded is False again.
    A 500 that heals within 5 attempts is never reported (the other test's faults)."""
    monkeypatch.setenv("KUBERL_BACKOFF_BASE_SECONDS", "0.05")
    monkeypatch.setenv("KUBERL_BACKOFF_MAX_SECONDS", "0.3")
    fault = Fault("POST", "configmaps", 500, times=8)
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        api.faults.append(fault)
        await api.create(GROUP, "rlexperiments", "team-a", experiment())

        def healed() -> bool:
            conditions = (get_rlx(api, "cpu-tiny").get("status") or {}).get("conditions") or []
            degraded = [c for c in conditions if c["type"] == "Degraded"]
            return fault.hits == fault.times and bool(degraded) and degraded[0]["status"] == "False"

        await eventually(healed, timeout=60, what="Degraded=False after the 500s stopped")
        assert degraded_reasons_seen(api, "rlexperiments", "cpu-tiny") == {"ApiError500"}
        events = [e for e in api.list("", "events", "team-a") if e.get("reason") == "ApiError500"]
        assert events and "attempts in a row" in events[0]["message"]
