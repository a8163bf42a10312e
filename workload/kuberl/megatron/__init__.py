"""The Megatron-core backend's verifiable parts: HF ↔ Megatron weight conversion (:mod:`.convert`,
pure torch) and model building / loading / export (:mod:`.model`, needs megatron-core)."""
