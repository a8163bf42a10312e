"""Where the inference replicas are, and following them while the run goes on.

The replicas' URLs are the run config's (``kuberl run``: ``settings.inferenceUrls``) or the pool's
headless-Service DNS names, one per replica index (a cluster). Trainer rank 0 then follows the pool
(:func:`follow_pool`): ``kuberl run`` rewrites a JSON list of URLs (``settings.replicas_file``) when
``kuberl scale`` resizes it; on a cluster the mounted run config (a ConfigMap the kubelet updates
in place) carries the experiment's ``spec.inference.replicas``, which ``kubectl scale rlx`` or an
autoscaler changes without replacing any pod (the pods' revision leaves it out).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

from ..api.contract import inference_pool_name, inference_replica_host
from ..rollout.client import InferenceClient
from ..runconfig import RunConfig, load_run_config
from ..settings import Settings

log = logging.getLogger("kuberl.trainer")
POLL_SECONDS = 1.0
PoolReader = Callable[[Path], list[str]]


def inference_urls(run: RunConfig, settings: Settings) -> list[str]:
    """Replica URLs: the run config's (local mode), else the pool's headless-Service DNS names."""
    if settings.inference_urls:
        return list(settings.inference_urls)
    try:
        plan = run.inference
    except ValueError as err:
        raise SystemExit(f"invalid spec: {err}") from err
    pool = settings.inference_service or inference_pool_name(run.experiment)
    port = run.spec.inference.port
    return [f"http://{inference_replica_host(pool, r)}:{port}" for r in range(plan.replicas)]


def pool_source(run: RunConfig, settings: Settings) -> tuple[Path, PoolReader] | None:
    """The file that says which replicas the pool has, and how to read it: ``kuberl run``'s list of
    URLs, else the run config the process was started with; None when there is neither."""
    if settings.replicas_file is not None:
        return settings.replicas_file, lambda path: [str(u) for u in json.loads(path.read_text())]
    if run.source is not None and not settings.inference_urls:
        return run.source, lambda path: inference_urls(load_run_config(path), settings)
    return None


async def follow_pool(client: InferenceClient, path: Path, read: PoolReader) -> None:
    """Resize the client's pool (:meth:`InferenceClient.resize`) whenever ``path`` changes; a file
    that cannot be read is reported once per change and otherwise ignored (the pool stays)."""
    seen: int | None = None
    while True:
        await asyncio.sleep(POLL_SECONDS)
        try:
            changed = path.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        if changed == seen:
            continue
        seen = changed
        try:
            client.resize(read(path))
        except (ValueError, TypeError, OSError, SystemExit) as err:
            log.warning("%s: cannot read the pool's replicas (%s); the pool stays as it is", path, err)
