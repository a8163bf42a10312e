"""The FSDP2 training backend (:mod:`.actor`)."""
