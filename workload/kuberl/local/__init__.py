"""Local mode (``kuberl run``): an RLExperiment's roles as processes on this machine.

- :mod:`.run`: the run itself — the manifest read and overridden, the processes planned (the same entry
  points and environment as the pods), started, supervised and stopped, the summary;
- :mod:`.processes`: keeping children alive (restarts, pinned cores, ports, log tails);
- :mod:`.workdir`: the files the run's processes share in its work directory (the pool file, ``kuberl
  scale``'s wish, the run id and checkpoint key kept for a resume);
- :mod:`.autoscale`: ``spec.inference.autoscale`` applied to the local pool, by the operator's rule.
"""

from .run import (
    LOCAL_MAPPINGS,
    LOCAL_ONLY,
    POD_ONLY,
    REPO_ROOT,
    apply_overrides,
    load_experiment,
    plan_run,
    rollout_cores,
    run_local,
    warmup_cut_short,
)

__all__ = ["LOCAL_MAPPINGS", "LOCAL_ONLY", "POD_ONLY", "REPO_ROOT", "apply_overrides", "load_experiment", "plan_run",
           "rollout_cores", "run_local", "warmup_cut_short"]
