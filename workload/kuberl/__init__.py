"""KubeRL workload: API models, rollout, inference, trainer, weights, checkpoints."""
