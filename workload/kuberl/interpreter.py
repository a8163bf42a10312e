"""How a long-lived KubeRL process tunes its interpreter: the set-up heap out of the garbage collector's
reach, and the GIL handed between threads often. Torch-free: the rollout process imports it too."""

from __future__ import annotations

import gc
import sys

GIL_SWITCH_SECONDS = 0.0002  # CPython's default is 0.005


def freeze_set_up_heap() -> None:
    """Collect once, then freeze what set-up left alive (``gc.freeze``, as Megatron's manual GC does):
    a full collection would otherwise walk those objects (≈ 440,000 in a trainer of the main example,
    most of torch and transformers in a replica), stalling the process for 100–250 ms each time —
    every ~150 steps in the main example, the trainer's step or the replica's generation waiting.
    Frozen, a collection walks only what the process allocated since; frozen objects that die later
    are still freed by reference counting (only their cycles are not)."""
    gc.collect()
    gc.freeze()


def hand_over_the_gil_often() -> None:
    """The GIL handed between Python threads every :data:`GIL_SWITCH_SECONDS`.

    A trainer (or engine) thread takes the GIL for every operator it dispatches and every autograd
    hook; the same process runs an event loop (rollout, gateway, HTTP) whose Python keeps the GIL
    for the whole switch interval. At CPython's 5 ms a tiny model's forward and backward took 8×
    as long next to a busy loop (2.7 s instead of 0.33 s); at 0.2 ms, 1.1×.
    """
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
