"""Shared fixtures: the example manifests, a minimal valid RLExperiment document, and a checkpoint
URI on a directory or on a real HTTP S3 (moto's server, through boto3)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed as dist
import yaml
from filelock import FileLock
from moto.server import ThreadedMotoServer

from kuberl.local.processes import free_port

from .tiers import pytest_runtest_makereport, pytest_runtest_protocol  # noqa: F401  (the slow marker's guard)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


MINIMAL: dict[str, Any] = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "RLExperiment",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {
        "model": {"path": "s3://models/tiny/"},
        "dataset": {"path": "builtin:arithmetic"},
        "reward": {"function": "kuberl.rewards:exact_match"},
    },
}


@pytest.fixture
def minimal() -> dict[str, Any]:
    return copy.deepcopy(MINIMAL)


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch, s3_endpoint):
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    return s3_endpoint


@pytest.fixture(params=["file", "s3"])
def uri(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/ckpt/"
    endpoint = request.getfixturevalue("aws_env")
    bucket = f"b{request.node.name.lower().replace('[', '-').replace(']', '').replace('_', '-')}"[:60]
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/exp1/"


def share_cores_among_xdist_workers() -> None:
    """Under pytest-xdist, worker i keeps cores 2i and 2i + 1 when the machine has them (its training
    runs pin their processes inside them, instead of every worker's runs on cores 0 and 1); a worker
    past the last pair (scripts/test starts one more than there are pairs) shares every core. Torch in
    the worker's own process uses one thread per core it may expect to have."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker:
        return
    cores, index = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw"))
    if len(cores) >= 4 and len(cores) >= 2 * (index + 1):
        os.sched_setaffinity(0, cores[2 * index:2 * index + 2])
        torch.set_num_threads(2)
    else:
        torch.set_num_threads(max(1, len(cores) // count))


share_cores_among_xdist_workers()


# Tests that run whole training runs (a minute or more each), then modules of such runs, longest first
# (pieces of a test id). They are collected first, so that the workers start on them at once and the
# short tests fill the gaps. pytest-xdist hands out the first quarter of the list round-robin (test i
# to worker i mod n) and the rest one at a time to whichever worker is free (scripts/test: --dist load
# --maxschedchunk 1). The three kubelet stand-in tests (test_e2e*.py) run one at a time on a host
# (test_e2e.host_node), so they sit three places apart: with scripts/test's three workers on two cores
# they go to the same worker, one after the other, and nobody waits for the lock.
LONG_FIRST = ("test_an_openai_client_agent", "test_the_cpu_agent_learns", "test_the_users_agent_deployment",
              "test_vllm_local.py", "test_the_cpu_example_learns", "test_s3_model_data_and_checkpoints",
              "test_killed_processes", "test_kubectl_apply_trains", "test_local_run.py", "test_curves.py",
              "test_after_the_run.py", "test_workflow_door.py", "test_gateway.py", "test_actor.py",
              "test_weight_transport.py", "test_multiturn.py", "test_fuzz.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, piece in enumerate(LONG_FIRST) if piece in item.nodeid), len(LONG_FIRST))

    items.sort(key=rank)


def run_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test run's temp dir, shared by every pytest-xdist worker (each worker's own base temp dir
    is a child of it); the base temp dir itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


TOOL_SFT_STEPS = 150  # enough that most episodes call the calculator and copy its answer


@pytest.fixture(scope="session")
def tool_warmed_weights(tmp_path_factory) -> Path:
    """The tiny model (seed 0) after SFT on ``builtin:multiplication-tools`` demonstrations: trained
    once per test run (it takes most of a minute on one core) and kept under the run's temp dir."""
    from kuberl.api.spec import DatasetSource
    from kuberl.data.datasets import examples
    from kuberl.models.text import TextCodec
    from kuberl.models.tiny import char_tokenizer, tiny_qwen2
    from kuberl.policy.sft import sft_warmup

    path = run_temp_dir(tmp_path_factory) / "tool-warmed-tiny-qwen2.pt"
    with FileLock(f"{path}.lock"):  # one worker trains it, the others wait and load it
        if not path.exists():
            tok = char_tokenizer()
            model = tiny_qwen2(len(tok), seed=0)
            sft_warmup(model, TextCodec(tok), examples(DatasetSource(path="builtin:multiplication-tools"), 0),
                       TOOL_SFT_STEPS, 64, 2e-3)
            torch.save(model.state_dict(), f"{path}.partial")
            os.replace(f"{path}.partial", path)
    return path


def load_tool_warmed(weights: Path) -> tuple[Any, Any]:
    """A fresh copy of the tool-warmed tiny model (from ``tool_warmed_weights``) and its tokenizer."""
    from kuberl.models.tiny import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model, tok


@pytest.fixture
def tool_warmed_model(tool_warmed_weights):
    """The tool-warmed tiny model and its tokenizer, a fresh copy per test (tests may train or change it)."""
    return load_tool_warmed(tool_warmed_weights)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank (FSDP2 needs one), for a test module."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
