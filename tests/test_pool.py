"""Trainer rank 0 follows its inference pool (kuberl.trainer.pool): on a cluster through the mounted
run config, whose spec.inference.replicas kubectl scale changes without replacing a pod; locally
through kuberl run's list of URLs."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import yaml

from kuberl.api.spec import RLExperimentSpec
from kuberl.rollout.client import InferenceClient
from kuberl.runconfig import load_run_config, write_run_config
from kuberl.settings import resolve
from kuberl.trainer.pool import follow_pool, inference_urls, pool_source

from .conftest import EXAMPLES


def write_config(path: Path, replicas: int) -> None:
    doc = yaml.safe_load((EXAMPLES / "cpu-tiny.yaml").read_text())
    doc["spec"]["inference"]["replicas"] = replicas
    write_run_config(path, "tiny", RLExperimentSpec.model_validate(doc["spec"]), "run-1")
    later = time.time_ns() + 10**9 * replicas  # a new mtime even within the filesystem's granularity
    os.utime(path, ns=(later, later))


@pytest.mark.slow
async def test_the_trainer_follows_the_pool_size_in_its_mounted_run_config(tmp_path: Path):
    path = tmp_path / "config.yaml"
    write_config(path, 1)
    run = load_run_config(path)
    settings = resolve({}, run.settings)
    source = pool_source(run, settings)
    assert source is not None and source[0] == path
    async with InferenceClient(inference_urls(run, settings), "token", health_interval=60.0) as client:
        following = asyncio.create_task(follow_pool(client, *source))
        try:
            for replicas in (3, 2):
                write_config(path, replicas)
                deadline = time.monotonic() + 10
                while len(client.replicas) != replicas and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert [r.url for r in client.replicas] == [
                    f"http://tiny-inference-r{r}-h0.tiny-inference:8000" for r in range(replicas)]
            first, joined = client.replicas
            assert not first.needs_weights and joined.needs_weights  # a joiner waits for weights
        finally:
            following.cancel()
