"""The Megatron-core backend, verified on CPU over gloo: HF ↔ Megatron weight conversion
(:mod:`.convert`, pure torch), the tensor-parallel split (:mod:`.tensor_parallel`, pure), model
building / loading / export (:mod:`.model`), vocabulary-parallel log-probs and entropy
(:mod:`.logprobs`), and the shim that lets megatron-core run on the CPU (:mod:`.cpu`). The training
loop (optimizer, pipeline schedule, checkpoints, weight sync) is not built yet."""
