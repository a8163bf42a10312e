"""What a policy update is, whatever the backend: batches, packing, advantages and algorithms, the
PPO loss, supervised warm-up, and the step (:mod:`.actor`) the FSDP2 and Megatron backends share."""
