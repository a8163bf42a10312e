"""Trainer: advantages, the decoupled PPO loss, FSDP2 training loop."""
