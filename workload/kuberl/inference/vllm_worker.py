"""Mixed into every vLLM worker (engine argument ``worker_extension_cls``); called by
:class:`~.vllm_engine.VLLMEngine` through ``AsyncLLM.collective_rpc``.

Runs inside vLLM's worker processes, where ``self.model_runner.model`` is the served model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file


class WeightLoaderExtension:
    model_runner: Any
    rank: int

    def kuberl_load_weights(self, path: str) -> int:
        """Load a full Hugging Face-named state dict from a safetensors file, in place. vLLM's
        ``reload_weights`` maps the names onto its fused and sharded parameters and redoes what
        happened after the first load (e.g. the CPU backend's repacking of linear weights for
        oneDNN, which leaves the parameter itself empty). Returns how many tensors were read."""
        weights = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        return len(weights)

    def kuberl_dump_weights(self, directory: str) -> str:
        """Write this worker's parameters (vLLM names, this worker's shard) to
        ``directory/rank<N>.safetensors``; returns the path. Parameters a backend repacked into
        kernel format are empty here (size 0)."""
        path = Path(directory) / f"rank{getattr(self, 'rank', 0)}.safetensors"
        params = {name: p.detach().cpu().contiguous() for name, p in self.model_runner.model.named_parameters()}
        save_file(params, str(path))
        return str(path)
