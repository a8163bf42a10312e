"""Weight exchange from trainer to inference replicas (``spec.weightSync.mode``).

Contract: after each step every trainer rank calls ``push(source, version)`` with its
:class:`~kuberl.weights.p2p.WeightSource` (the actor: full state dict on demand, local shards).
``push`` takes its own copy of the weights and may return before the replicas have them, so the
next training step overlaps the transfer; ``wait()`` returns the seconds the last exchange took
once every replica serves its version. Exchanges complete in order (a push first waits for the
previous one). Generation meanwhile continues on the old version, which the staleness bound
accounts for.

- ``p2p`` (default, :mod:`.p2p`): every trainer rank sends its own FSDP2 shard straight to the
  replicas, planned by :mod:`.plan` from the pods' topology labels.
- ``broadcast``: the naive baseline: the full state is gathered on rank 0, which sends it to
  each replica over the inference HTTP contract.
- ``disk``: rank 0 writes the full state as a safetensors file into ``spec.weightSync.directory`` (on
  a ReadWriteMany volume the trainer and the inference pods share; local mode uses its work dir) and each replica reads
  it from there: for debugging, LoRA-style cases, or when HTTP bodies of the model's size hurt.

The modes live in :mod:`.sync`. This package module imports nothing, so a process that only reads
pod topology (:mod:`.discovery`, e.g. the ``kuberl run`` CLI) does not import torch.
"""
