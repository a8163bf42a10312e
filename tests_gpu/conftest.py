"""The CUDA path, on one GPU (``scripts/gpu-check`` runs these there). Without a CUDA device every test
here is skipped, saying so; nothing in CI needs one.

``KUBERL_GPU_REPORT``: a JSON file the tests add their measurements to (the gap between engine and
trainer, step times), which ``scripts/gpu-check`` folds into its summary."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent
NO_CUDA = "no CUDA device here: the GPU checks run on a machine with one (scripts/gpu-check)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Without CUDA, this directory's tests are skipped — only these: a session that also collects
    ``tests/`` runs those."""
    if not torch.cuda.is_available():
        for item in items:
            if item.path.is_relative_to(HERE):
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def report(**measurements: Any) -> None:
    """Add ``measurements`` to the run's report file (when ``KUBERL_GPU_REPORT`` names one) and print them."""
    print(json.dumps(measurements))
    where = os.environ.get("KUBERL_GPU_REPORT")
    if where:
        path = Path(where)
        known = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps(known | measurements, indent=2))


@pytest.fixture(scope="session")
def nccl_world_of_one() -> Iterator[torch.device]:
    """An NCCL process group of one rank on cuda:0 (FSDP2 and Megatron need one); the device."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()
