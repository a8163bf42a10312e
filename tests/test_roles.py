"""A local process gets the environment of the pod the operator renders for the same role and manifest,
up to the documented host/port mappings (kuberl.local.LOCAL_MAPPINGS)."""

import os
from pathlib import Path
from typing import Any

import pytest

from kuberl.api import RLExperiment
from kuberl.api.contract import inference_pod_name, trainer_pod_name
from kuberl.api.roles import gang_may_restart, torchrun_process_env, trainer_node_env
from kuberl.local import LOCAL_MAPPINGS, LOCAL_ONLY, POD_ONLY, plan_run
from kuberl_operator.render import render_resource

from .conftest import ROOT

LOCAL_EXAMPLES = sorted((ROOT / "examples").glob("cpu-*.yaml"))


def pod_env(pod: dict[str, Any]) -> dict[str, str | None]:
    """name → value (None for a value from a Secret or the downward API)."""
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def own(env: dict[str, str]) -> dict[str, str]:
    """What a local run sets, without what it inherits from this process."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def differences(pod: dict[str, str | None], local: dict[str, str]) -> list[str]:
    out = [f"{name}: the pod has it, the local process not" for name in sorted(pod.keys() - local.keys())
           if name not in POD_ONLY and not (name in LOCAL_MAPPINGS and name not in local)]
    out += [f"{name}: the local process has it, the pod not" for name in sorted(local.keys() - pod.keys())
            if name not in LOCAL_ONLY and name not in LOCAL_MAPPINGS]
    out += [f"{name}: pod {pod[name]!r}, local {local[name]!r}" for name in sorted(pod.keys() & local.keys())
            if pod[name] is not None and name not in LOCAL_MAPPINGS and pod[name] != local[name]]
    return out


@pytest.mark.parametrize("example", LOCAL_EXAMPLES, ids=lambda p: p.name)
def test_a_local_process_has_its_pods_environment_up_to_hosts_and_ports(example: Path, tmp_path: Path):
    run = plan_run(example, [], None, tmp_path / "work", False)
    assert isinstance(run.obj, RLExperiment)
    pods = {m["metadata"]["name"]: m for m in render_resource(run.obj) if m["kind"] == "Pod"}
    name = run.obj.metadata.name
    replica_pod = pods[inference_pod_name(f"{name}-inference", 0, 0)]
    rank_pod = pods[trainer_pod_name(f"{name}-trainer", 0)]
    assert differences(pod_env(replica_pod), own(run.replica_env(0))) == []
    assert differences(pod_env(rank_pod), own(run.rank_env(0, 29999))) == []
    assert own(run.rank_env(0, 29999))["MASTER_PORT"] == "29999"  # mapped, not dropped


def test_a_renamed_variable_on_one_side_is_a_difference():
    pod = {"KUBERL_ROLE": "trainer", "WORLD_SIZE": "2", "KUBERL_API_TOKEN": None}
    assert differences(pod, {"KUBERL_ROLE": "trainer", "WORLD_SIZE": "2", "KUBERL_API_TOKEN": "t" * 32}) == []
    assert differences(pod, {"KUBERL_ROLE": "trainer", "WORLD_SIZE": "1", "KUBERL_API_TOKEN": "t"}) == \
        ["WORLD_SIZE: pod '2', local '1'"]
    assert differences(pod, {"KUBERL_ROLE": "trainer", "KUBERL_API_TOKEN": "t", "WORLDSIZE": "2"}) == [
        "WORLD_SIZE: the pod has it, the local process not", "WORLDSIZE: the local process has it, the pod not"]


def test_torchrun_numbers_ranks_node_by_node():
    node = trainer_node_env(("t-n0.t", 29500), nodes=2, procs_per_node=4, node_rank=1, inference_service=None)
    assert node["WORLD_SIZE"] == "8"
    assert [torchrun_process_env(node, local)["RANK"] for local in range(4)] == ["4", "5", "6", "7"]


def test_the_gang_restarts_until_the_backoff_limit():
    assert [gang_may_restart(n, 3) for n in range(5)] == [True, True, True, False, False]
