"""A replica that spans hosts, rendered: one pod per (replica, host), each told its rank in the replica,
their count and where they meet (the leader's pod, host 0, under the pool's headless Service); only the
leader is probed (it serves HTTP); every pod in the experiment's gang."""

from __future__ import annotations

import copy

from kuberl.api.contract import (
    ENV_REPLICA,
    ENV_REPLICA_HOST,
    ENV_REPLICA_HOSTS,
    ENV_REPLICA_LEADER,
    LABEL_HOST,
    LABEL_REPLICA,
    REPLICA_GROUP_PORT,
)

from .conftest import MINIMAL
from .test_builders import by_kind, container, env, render


def split_pool(replicas: int = 2) -> dict:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["scheduling"] = {"gang": "volcano"}
    doc["spec"]["inference"] = {"accelerator": "cpu", "engine": "torch", "replicas": replicas, "tensorParallel": 2,
                                "acceleratorsPerNode": 1}
    return doc


def test_each_process_of_a_split_replica_is_a_pod_that_knows_its_rank_and_its_leader():
    manifests = render(split_pool())
    pods = [p for p in by_kind(manifests, "Pod") if LABEL_HOST in p["metadata"]["labels"]]
    where = {(p["metadata"]["labels"][LABEL_REPLICA], p["metadata"]["labels"][LABEL_HOST]): p for p in pods}
    assert sorted(where) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    [service] = [s for s in by_kind(manifests, "Service") if s["spec"].get("clusterIP") == "None"
                 and where[("1", "0")]["spec"]["subdomain"] == s["metadata"]["name"]]
    for (replica, host), pod in where.items():
        variables = env(pod)
        leader = where[(replica, "0")]["spec"]["hostname"]
        assert variables[ENV_REPLICA] == replica and variables[ENV_REPLICA_HOST] == host
        assert variables[ENV_REPLICA_HOSTS] == "2"
        assert variables[ENV_REPLICA_LEADER] == f"{leader}.{service['metadata']['name']}:{REPLICA_GROUP_PORT}"
        assert ("readinessProbe" in container(pod)) == (host == "0")  # the leader serves; its workers follow
    [group] = by_kind(manifests, "PodGroup")
    assert group["spec"]["minMember"] == len(by_kind(manifests, "Pod")) == 4 + 1  # 2 replicas × 2 hosts, 1 trainer


def test_a_one_host_replica_gets_no_replica_group_env():
    doc = split_pool(replicas=1)
    doc["spec"]["inference"]["tensorParallel"] = 1
    for pod in by_kind(render(doc), "Pod"):
        assert not {ENV_REPLICA_HOST, ENV_REPLICA_HOSTS, ENV_REPLICA_LEADER} & set(env(pod))
