"""The Megatron-core backend, verified on CPU over gloo: HF ↔ Megatron weight conversion for dense
Qwen2 / Qwen3 / Llama (:mod:`.convert`, pure torch), the tensor-parallel split (:mod:`.tensor_parallel`, pure), model
building / loading / export (:mod:`.model`), vocabulary-parallel log-probs and entropy
(:mod:`.logprobs`), the actor that trains it with the FSDP actor's step (:mod:`.actor`), and the shim
that lets megatron-core run on the CPU (:mod:`.cpu`). Tensor parallelism only so far: pipeline and
expert parallelism, Megatron's distributed optimizer and ``dist_checkpointing`` are not built
(``kuberl.api.support`` refuses them)."""
