"""The Tinker-compatible front door: researchers drive KubeRL's training and sampling from their own Python
loop with the ``tinker`` SDK (``forward_backward``, ``optim_step``, ``save_weights_and_get_sampling_client``,
``sample``, ``save_state``), unmodified. ``docs/tinker.md`` says what it serves and what it refuses.

- :mod:`.wire` — the protocol-buffer bodies (forward/backward in and out, samples out);
  :mod:`.schema` — the JSON requests; :mod:`.errors` — what a client is told, with its HTTP status.
- :mod:`.losses` — the built-in losses (cross-entropy, importance sampling, PPO, CISPO), as formulas.
- :mod:`.trainee` — one client's training model (its LoRA adapter on the shared base, or a whole copy);
  :mod:`.sampler` — a fixed set of weights on the torch engine.
- :mod:`.states` — saved training states in a checkpoint store.
- :mod:`.sessions` — who holds which session, heartbeats and expiry; :mod:`.futures` — long work as
  futures the client polls; :mod:`.metrics` — per-client numbers for Prometheus.
- :mod:`.service` — models and samplers per client, their limits, the round-robin training worker;
  :mod:`.server` — the HTTP routes and keys.
- :mod:`.serve` — ``kuberl serve FILE``: all of it for a manifest's model on one machine.
"""
