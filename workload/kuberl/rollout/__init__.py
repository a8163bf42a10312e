"""Asynchronous rollout: admission control, workflows, rewards, buffer."""
