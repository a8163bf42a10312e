"""Mixed into every vLLM worker (engine argument ``worker_extension_cls``); called by
:class:`~.vllm_engine.VLLMEngine` through ``AsyncLLM.collective_rpc``.

Runs inside vLLM's worker processes, where ``self.model_runner.model`` is the served model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ReloadReport(logging.Filter):
    """Collects the layer classes vLLM's layer-wise reload reports as not loaded (its warning
    ``"%s: Failed to load weights"``), and drops that warning for layers with buffers only (the
    rotary embedding's cos/sin cache is computed, not loaded: the warning would only mislead)."""

    def __init__(self, buffer_only: set[str]) -> None:
        super().__init__()
        self.buffer_only = buffer_only
        self.failed: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple) and record.args:
            self.failed.add(str(record.args[0]))
            return str(record.args[0]) not in self.buffer_only
        return True


@contextmanager
def _reload_report(buffer_only: set[str]) -> Iterator[_ReloadReport]:
    report = _ReloadReport(buffer_only)
    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addFilter(report)
    try:
        yield report
    finally:
        logger.removeFilter(report)


def _layer_classes(model: Any) -> tuple[set[str], set[str]]:
    """(classes of layers with parameters of their own, classes of layers with buffers only)."""
    with_params = {type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is not None}
    with_buffers = {type(m).__name__ for m in model.modules() if next(m.buffers(recurse=False), None) is not None}
    return with_params, with_buffers - with_params


class WeightLoaderExtension:
    model_runner: Any
    rank: int

    def kuberl_load_weights(self, path: str, aliases: dict[str, str]) -> int:
        """Load a full Hugging Face-named state dict from a safetensors file, in place. vLLM's
        ``reload_weights`` maps the names onto its fused and sharded parameters and redoes what
        happened after the first load (e.g. the CPU backend's repacking of linear weights for
        oneDNN, which leaves the parameter itself empty) — but only for layers whose own names
        arrive. So every alias of a tied parameter (``lm_head.weight`` → the embedding) is given
        too, as the same tensor: without it the output layer keeps serving its first weights.
        Returns how many tensors were read.

        Raises when vLLM reports a layer with parameters as not reloaded (a layer with buffers only,
        such as the rotary embedding's cos/sin cache, is computed, not loaded: that one is fine).
        """
        weights = load_file(path)
        for alias, source in aliases.items():
            weights[alias] = weights[source]
        with_params, buffer_only = _layer_classes(self.model_runner.model)
        with _reload_report(buffer_only) as report:
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        stale = sorted(report.failed & with_params)
        if stale:
            raise RuntimeError(f"vLLM did not reload the weights of {stale}: the update lacks their names")
        return len(weights)

    def kuberl_dump_weights(self, directory: str) -> str:
        """Write this worker's parameters (vLLM names, this worker's shard) to
        ``directory/rank<N>.safetensors``; returns the path. Parameters a backend repacked into
        kernel format are empty here (size 0)."""
        path = Path(directory) / f"rank{getattr(self, 'rank', 0)}.safetensors"
        params = {name: p.detach().cpu().contiguous() for name, p in self.model_runner.model.named_parameters()}
        save_file(params, str(path))
        return str(path)
