"""Inference server: one HTTP contract (generate, pause/resume, weights, version, health, metrics)
with engines behind it: ``torch`` (embedded, pure PyTorch) and ``vllm`` (where vLLM is installed)."""
