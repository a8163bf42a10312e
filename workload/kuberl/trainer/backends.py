"""The trainer backends, by ``spec.trainer.backend``: one builder each (:data:`kuberl.policy.backend.ActorBuilder`),
imported only when a run asks for it (megatron-core is a heavy import). A new backend is a package
with a ``build`` and one line here (and its name in :class:`kuberl.api.spec.Backend`)."""

from __future__ import annotations

import importlib

from ..api.spec import Backend
from ..policy.backend import ActorBuilder

BUILDERS: dict[Backend, str] = {
    Backend.FSDP: "kuberl.fsdp.backend",
    Backend.MEGATRON: "kuberl.megatron.backend",
}


def builder(backend: Backend) -> ActorBuilder:
    """The ``build`` of ``backend``'s module."""
    return importlib.import_module(BUILDERS[backend]).build
