"""Pure status aggregation: pod health, pool/job/experiment phases, condition bookkeeping."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from random import Random
from typing import Any

import pytest

from kuberl.api.contract import LABEL_REPLICA
from kuberl_operator.progress import fetch_all, progress_status
from kuberl_operator.retry import Backoff
from kuberl_operator.status import (
    experiment_status,
    job_status,
    merge_conditions,
    pod_health,
    pool_status,
    trainjob_status,
)


def pod(name, phase="Running", ready=False, waiting=None, node="n1", terminated=None, unschedulable=False,
        replica=None):
    state = {"waiting": {"reason": waiting, "message": "m"}} if waiting else (
        {"terminated": terminated} if terminated else {"running": {}})
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})
    labels = {} if replica is None else {LABEL_REPLICA: str(replica)}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": None if unschedulable else node},
            "status": {"phase": phase, "conditions": conds, "containerStatuses": [{"name": "c", "state": state}]}}


def test_pod_health_reasons():
    assert pod_health(pod("a", ready=True)).ready
    assert pod_health(pod("a", waiting="ImagePullBackOff")).deterministic_failure
    assert not pod_health(pod("a", waiting="CrashLoopBackOff")).deterministic_failure
    failed = pod_health(pod("a", phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    assert failed.problem == ("PodFailed", "OOMKilled (exit code 137)")
    unsched = pod_health(pod("a", phase="Pending", unschedulable=True))
    assert unsched.problem[0] == "Unschedulable" and "Insufficient" in unsched.problem[1]


SELECTOR = {"kuberl.io/role": "inference", "kuberl.io/inference-pool": "p"}


def test_pool_phases_and_ready_replicas():
    spec = {"replicas": 2, "hostsPerReplica": 2}
    pods = [pod(f"p-r{r}-h{h}", ready=(r == 0), replica=r) for r in range(2) for h in range(2)]
    st = pool_status(spec, 3, pods, SELECTOR)
    assert (st["phase"], st["readyReplicas"], st["readyPods"], st["observedGeneration"]) == ("Initializing", 1, 2, 3)
    all_ready = [pod(f"p-r{r}-h{h}", ready=True, replica=r) for r in range(2) for h in range(2)]
    st = pool_status(spec, 3, all_ready, SELECTOR)
    assert st["phase"] == "Running" and st["readyReplicas"] == 2
    # replicas are counted by their label, not by a name pattern: a pool named "x-r1-h" stays right
    named_alike = [pod(f"x-r1-h-r{r}-h{h}", ready=(r == 1), replica=r) for r in range(2) for h in range(2)]
    assert pool_status(spec, 3, named_alike, SELECTOR)["readyReplicas"] == 1
    assert pool_status({**spec, "suspend": True}, 3, [], SELECTOR)["phase"] == "Suspended"
    assert pool_status(spec, 1, [pod("p-r0-h0", waiting="InvalidImageName")], SELECTOR)["phase"] == "Failed"
    assert pool_status(spec, 1, [], SELECTOR)["phase"] == "Pending"


def test_a_pools_scale_status_counts_the_replicas_that_have_pods_and_names_their_selector():
    """What a scale subresource reads: ``replicas`` now (not the spec's wish), the selector as text."""
    spec = {"replicas": 3, "hostsPerReplica": 2}
    pods = [pod(f"p-r{r}-h{h}", ready=True, replica=r) for r in (0, 1) for h in range(2)]
    pods.append(pod("p-r4-h0", ready=True, replica=4))  # a replica scaled away, still going
    st = pool_status(spec, 3, pods, SELECTOR)
    assert (st["replicas"], st["readyReplicas"]) == (3, 2)
    assert st["selector"] == "kuberl.io/inference-pool=p,kuberl.io/role=inference"


def test_job_phases():
    spec = {"nodes": 2}
    assert job_status(spec, 1, [pod("t-n0", ready=True), pod("t-n1", ready=True)])["phase"] == "Running"
    done = [pod(f"t-n{i}", phase="Succeeded", terminated={"exitCode": 0}) for i in range(2)]
    assert job_status(spec, 1, done)["phase"] == "Succeeded"
    one_failed = [pod("t-n0", ready=True), pod("t-n1", phase="Failed", terminated={"exitCode": 1})]
    st = job_status(spec, 1, one_failed, restarts=2)
    assert st["phase"] == "Failed" and st["restarts"] == 2
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "t-n1" in degraded["message"]


def test_trainjob_phases_follow_kubeflow_trainers_status():
    """A TrainJob's conditions and its child Job "node" (jobsStatus), as Kubeflow Trainer writes them."""
    spec = {"nodes": 2}

    def of(*conditions: tuple[str, str], node: dict | None = None, **extra: Any) -> dict:
        status = {"conditions": [{"type": t, "status": "True", "reason": r, "message": f"{t} says {r}"}
                                 for t, r in conditions], "jobsStatus": [{"name": "node", **(node or {})}]}
        return trainjob_status({**spec, **extra}, 4, {"status": status})

    assert of()["phase"] == "Pending"
    assert of(node={"active": 1})["phase"] == "Initializing"
    running = of(node={"active": 1, "ready": 1})
    assert (running["phase"], running["readyNodes"]) == ("Running", 2)
    assert of(("Complete", "JobsCompleted"), node={"succeeded": 1})["phase"] == "Succeeded"
    failed = of(("Failed", "BackoffLimitExceeded"), node={"failed": 1})
    assert failed["phase"] == "Failed"
    degraded = next(c for c in failed["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "BackoffLimitExceeded")
    assert "Failed says BackoffLimitExceeded" in degraded["message"]
    queued = of(("Suspended", "Suspended"))  # Kueue holds it until admission; we did not suspend it
    ready = next(c for c in queued["conditions"] if c["type"] == "Ready")
    assert (queued["phase"], ready["reason"]) == ("Pending", "QueuedForAdmission")
    assert of(("Suspended", "Suspended"), suspend=True)["phase"] == "Suspended"
    assert trainjob_status(spec, 1, None)["phase"] == "Pending"  # not created yet


def test_experiment_phase_follows_children():
    def exp(pool_phase, job_phase, suspend=False):
        return experiment_status(1, suspend, ("p", {"phase": pool_phase}), ("j", {"phase": job_phase}))["phase"]

    assert exp("Running", "Running") == "Running"
    assert exp("Initializing", "Running") == "Initializing"
    assert exp(None, None) == "Pending"
    assert exp("Running", "Succeeded") == "Succeeded"
    assert exp("Failed", "Running") == "Failed"
    assert exp("Running", "Running", suspend=True) == "Suspended"


def test_child_degraded_condition_climbs_with_its_reason():
    job = {"phase": "Failed", "conditions": [{"type": "Degraded", "status": "True", "reason": "ImagePullBackOff",
                                              "message": "pod t-n0: Back-off pulling image"}]}
    st = experiment_status(4, False, ("p", {"phase": "Running"}), ("j", job))
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ImagePullBackOff"
    assert degraded["message"] == "TrainerJob j: pod t-n0: Back-off pulling image"
    assert degraded["observedGeneration"] == 4


def test_a_valid_spec_that_would_lose_its_model_says_so_in_spec_valid():
    from kuberl.api import RLExperiment
    from kuberl.api.resolve import cluster_warnings

    from .conftest import MINIMAL

    spec = RLExperiment.model_validate(MINIMAL).spec
    warnings = tuple(str(w) for w in cluster_warnings(spec))
    assert len(warnings) == 1 and warnings[0].startswith("spec.checkpoint.uri: is unset")
    st = experiment_status(2, False, ("p", {"phase": "Running"}), ("j", {"phase": "Running"}), warnings)
    valid = next(c for c in st["conditions"] if c["type"] == "SpecValid")
    assert (valid["status"], valid["reason"], valid["message"]) == ("True", "ValidWithWarnings", warnings[0])
    kept = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": "s3://b/run/"})})
    assert cluster_warnings(kept) == []
    st = experiment_status(2, False, ("p", {"phase": "Running"}), ("j", {"phase": "Running"}))
    assert next(c for c in st["conditions"] if c["type"] == "SpecValid")["reason"] == "Valid"


def test_transition_time_kept_while_status_unchanged():
    old = [{"type": "Ready", "status": "False", "reason": "Pending", "lastTransitionTime": "T0"}]
    same = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "Initializing"}], "T1")
    flipped = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "Running"}], "T1")
    assert same[0]["lastTransitionTime"] == "T0" and flipped[0]["lastTransitionTime"] == "T1"


def test_progress_url_and_status_mapping():
    from kuberl_operator.progress import progress_status, progress_url

    assert progress_url("exp", "team-a", "10.1.2.3") == "http://10.1.2.3:8080/progress"
    assert progress_url("exp", "team-a", None) is None  # no pod IP yet: not polled
    host = "http://{host}:{port}/progress"
    assert progress_url("exp", "team-a", None, host) == "http://exp-trainer-n0.exp-trainer.team-a.svc:8080/progress"
    assert progress_url("exp", "team-a", None, host, "kubeflow") == \
        "http://exp-trainer-master-0.team-a.svc:8080/progress"
    # a TrainJob's rank 0 (JobSet's random-named pod): by its DNS name, without a template too
    assert progress_url("exp", "team-a", None, None, "trainjob") == \
        "http://exp-trainer-node-0-0.exp-trainer.team-a.svc:8080/progress"
    assert progress_url("exp", "ns", None, "http://127.0.0.1:9/{name}/{namespace}") == "http://127.0.0.1:9/exp/ns"
    assert progress_status({"step": 3, "version": 3, "reward": 0.123456, "observedStaleness": 1,
                            "lastCheckpoint": None, "phase": "running", "maxStaleness": 2}) == {
        "step": 3, "version": 3, "reward": 0.1235, "observedStaleness": 1, "phase": "running"}


def test_gang_restart_decision():
    from kuberl_operator.status import gang_restart

    def pod(name, phase, waiting=None, code=None, uid=None, **extra):
        state = {"waiting": {"reason": waiting}} if waiting else {"terminated": {"exitCode": code}} if code else {}
        return {"metadata": {"name": name, "uid": uid or name},
                "status": {"phase": phase, "containerStatuses": [{"name": "c", "state": state}], **extra}}

    failed = [pod("t-n0", "Running"), pod("t-n1", "Failed", code=137)]
    restart = gang_restart(failed, 0, 3)
    assert restart is not None and not restart.preempted
    assert restart.reason.startswith("pod t-n1:") and "exit code 137" in restart.reason
    assert gang_restart(failed, 3, 3) is None  # past the limit: job_status fails the job
    assert gang_restart([pod("t-n0", "Running"), pod("t-n1", "Running")], 0, 3) is None
    assert gang_restart([pod("t-n0", "Failed", waiting="ImagePullBackOff")], 0, 3) is None

    preempted = pod("t-n1", "Running", conditions=[{"type": "DisruptionTarget", "status": "True",
                                                     "reason": "PreemptionByScheduler", "message": "by team-b"}])
    restart = gang_restart([pod("t-n0", "Running"), preempted], 3, 3)  # past the limit: still restarts
    assert restart is not None and restart.preempted and restart.disrupted == ("t-n1",)
    assert "PreemptionByScheduler: by team-b" in restart.reason
    assert gang_restart([pod("t-n0", "Running"), preempted], 3, 3, frozenset({"t-n1"})) is None  # answered once
    evicted = pod("t-n0", "Failed", reason="Evicted", message="The node was low on resource: memory.")
    assert gang_restart([evicted], 0, 0).preempted  # the kubelet's eviction: not the program's failure


@pytest.mark.parametrize("payload", [
    None, [], "text", {"step": "12"}, {"step": True}, {"reward": float("nan")}, {"reward": 1e300},
    {"last_checkpoint": "s3://" + "x" * 5000}, {"reward": {"nested": 1}},
])
def test_a_hostile_progress_reply_puts_nothing_odd_into_the_status(payload):
    out = progress_status(payload)
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for k, v in out.items()
               if k != "lastCheckpoint")
    assert out == {} or out.get("lastCheckpoint", "")[:5] == "s3://"


def serve_once_per_path(replies: dict[str, tuple[int, dict[str, str], bytes]]):
    """A real HTTP server answering each path with (status, headers, body)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, headers, body = replies[self.path]
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fetch_one(url: str, timeout: float = 2.0) -> Any:
    return asyncio.run(fetch_all([url], timeout))[0]


def test_an_oversized_progress_reply_is_ignored():
    server = serve_once_per_path({"/progress": (200, {}, b'{"step": 1, "pad": "' + b"x" * (1 << 20) + b'"}')})
    try:
        assert fetch_one(f"http://127.0.0.1:{server.server_port}/progress") is None
    finally:
        server.shutdown()


def test_a_redirecting_progress_reply_is_not_followed():
    server = serve_once_per_path({"/progress": (302, {"Location": "/elsewhere"}, b""),
                                  "/elsewhere": (200, {}, b'{"step": 5}')})
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        assert fetch_one(f"{base}/elsewhere") == {"step": 5}
        assert fetch_one(f"{base}/progress") is None
    finally:
        server.shutdown()


def dripping_server(seconds: float) -> tuple[int, threading.Event]:
    """A trainer stand-in that answers 200 and then one byte every 0.2 s for ``seconds``."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            conn, _ = listener.accept()
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not stop.is_set():
                time.sleep(0.2)
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], stop


def test_a_trainer_dripping_its_reply_costs_one_deadline_and_delays_no_other_experiment():
    """The deadline covers the whole reply (a byte every 0.2 s never resets it), and experiments are
    polled together: a dripping trainer next to a healthy one, both answered within about one deadline."""
    port, stop = dripping_server(seconds=30)
    good = serve_once_per_path({"/progress": (200, {}, b'{"step": 7}')})
    try:
        start = time.monotonic()
        replies = asyncio.run(fetch_all([f"http://127.0.0.1:{port}/progress",
                                         f"http://127.0.0.1:{good.server_port}/progress"], timeout=1.0))
        took = time.monotonic() - start
        assert replies == [None, {"step": 7}]
        assert took < 10, f"a dripping reply held the poll for {took:.1f} s"  # it would drip for 30 s
    finally:
        stop.set()
        good.shutdown()


def test_retries_of_objects_that_failed_together_spread_out_between_half_and_the_whole_delay():
    backoff = Backoff(base=1.0, cap=300.0, random=Random(7))
    delays = [backoff.failed(("exp", str(i)))[1] for i in range(100)]  # 100 objects, first failure each
    assert all(0.5 <= d < 1.0 for d in delays) and len({round(d, 3) for d in delays}) > 50
    key = ("exp", "0")
    for attempt in range(2, 12):
        got, delay = backoff.failed(key)
        full = min(300.0, 2.0 ** (attempt - 1))
        assert got == attempt and full / 2 <= delay < full
    assert backoff.failed(key, retry_after=1000.0)[1] == 1000.0  # never sooner than the server asks
    assert backoff.succeeded(key) and not backoff.succeeded(key)


async def test_the_api_rate_limit_lets_a_burst_through_then_qps_whatever_the_clock_reads():
    """A token bucket on a fake clock that starts at a large reading (a host up for days) and at 0
    (one booted a moment ago): the first ``burst`` calls go at once, the rest at ``qps`` a second, and
    no one-second window ever holds more than burst + qps calls."""
    from kuberl_operator.ratelimit import RateLimit

    for start in (0.0, 864000.0):
        now = [start]

        def clock(now: list[float] = now) -> float:
            return now[0]

        async def sleep(seconds: float, now: list[float] = now) -> None:
            now[0] += seconds

        limit = RateLimit(qps=10, burst=5, clock=clock, sleep=sleep)
        sent = []
        for _ in range(45):
            await limit.acquire()
            sent.append(now[0] - start)
        assert sent[:5] == [0.0] * 5 and sent[-1] == pytest.approx(4.0)  # 40 more at 10 a second
        assert max(sum(1 for t in sent if a <= t < a + 1) for a in sent) <= 5 + 10
        now[0] += 100  # idle: the bucket refills to burst, not beyond
        waits = [await limit.acquire() for _ in range(6)]
        assert waits[:5] == [0.0] * 5 and waits[5] == pytest.approx(0.1)


async def test_the_api_rate_limit_holds_across_concurrent_syncs():
    """Five syncs calling at once share one bucket: 50 calls at 200 a second after a burst of 1."""
    import asyncio
    import time

    from kuberl_operator.ratelimit import RateLimit

    limit, started = RateLimit(qps=200, burst=1), time.perf_counter()

    async def sync() -> None:
        for _ in range(10):
            await limit.acquire()

    await asyncio.gather(*(sync() for _ in range(5)))
    assert time.perf_counter() - started >= 49 / 200 * 0.95  # 50 calls: 1 at once, 49 at 200 a second


def test_a_rate_limit_that_cannot_send_anything_is_refused():
    from kuberl_operator.ratelimit import RateLimit

    for qps, burst in ((0, 10), (10, 0), (-1, 5)):
        with pytest.raises(ValueError, match="qps must be > 0 and burst"):
            RateLimit(qps, burst)


def test_pods_kueue_has_not_admitted_say_so_up_to_the_experiment():
    """Pods held by Kueue's admission gate (the experiment's pod group is queued): Pending, not
    Degraded, and Ready's reason says they wait for Kueue — on the job, the pool and the experiment."""
    def gated(name):
        held = {"metadata": {"name": name, "labels": {LABEL_REPLICA: "0"}},
                "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}, "status": {"phase": "Pending"}}
        return held

    job = job_status({"nodes": 2}, 1, [gated("t-n0"), gated("t-n1")])
    pool = pool_status({"replicas": 1}, 1, [gated("p-r0-h0")], SELECTOR)
    for status in (job, pool):
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert status["phase"] == "Pending" and ready["reason"] == "QueuedForAdmission" and "Kueue" in ready["message"]
        assert next(c for c in status["conditions"] if c["type"] == "Degraded")["status"] == "False"
    exp = experiment_status(1, False, ("p", pool), ("t", job))
    ready = next(c for c in exp["conditions"] if c["type"] == "Ready")
    assert exp["phase"] == "Pending" and ready["reason"] == "QueuedForAdmission"
    admitted = job_status({"nodes": 2}, 1, [pod("t-n0", phase="Pending", node=None), pod("t-n1", phase="Pending",
                                                                                           node=None)])
    assert next(c for c in admitted["conditions"] if c["type"] == "Ready")["reason"] == "Pending"
