"""The Megatron-core backend, verified on CPU over gloo: HF ↔ Megatron weight conversion for dense and
mixture-of-experts Qwen2 / Qwen3 / Llama (:mod:`.convert`, pure torch), tensor, pipeline, context, expert and
data parallelism (:mod:`.tensor_parallel`, :mod:`.pipeline` with megatron-core's 1F1B :mod:`.schedule`,
:mod:`.context_parallel`, :mod:`.expert_parallel`), model building / loading / export (:mod:`.model`),
vocabulary-parallel log-probs and entropy (:mod:`.logprobs`), the actor that trains it with the FSDP actor's
step (:mod:`.actor`) and its builder (:mod:`.backend`), ZeRO-1 AdamW (:mod:`.optimizer`), layout-free
checkpoints (:mod:`.checkpoint`), and the shim that lets megatron-core run on the CPU (:mod:`.cpu`).
What this build does not train (expert tensor parallelism, Megatron's ``dist_checkpointing``):
``kuberl.api.support`` refuses it."""
