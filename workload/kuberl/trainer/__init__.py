"""Trainer: the loop every rank runs (set-up, batches, steps, weight pushes, checkpoints, export).

The policy step is :mod:`kuberl.policy`; the backends are :mod:`kuberl.fsdp` and :mod:`kuberl.megatron`.
"""
