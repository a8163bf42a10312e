"""The ``vllm`` engine: the same HTTP contract on vLLM (production GPUs / Ascend via vLLM-Ascend).

vLLM is only installed in the CUDA and Ascend workload images. Here we fail with a clear message
instead of pretending; tests for this path are skipped where vLLM is missing.
"""

from __future__ import annotations

from typing import Any


def serve_vllm(run: Any, host: str, port: int) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            "spec.inference.engine is vllm but vLLM is not installed in this image; use the CUDA or "
            "Ascend workload image, or engine: torch"
        ) from err
    raise SystemExit("the vllm engine adapter is not implemented yet in this build; use engine: torch")
