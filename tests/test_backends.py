"""The trainer backends as a table: every ``spec.trainer.backend`` has a builder, and a backend's actor
implements the base actor's abstract hooks and overrides nothing else (the decoupled-PPO step is written
once, in :class:`kuberl.policy.actor.Actor`)."""

from __future__ import annotations

import inspect

import pytest

from kuberl.api.spec import Backend
from kuberl.policy.actor import Actor
from kuberl.trainer.backends import BUILDERS, builder


@pytest.mark.parametrize("backend", list(Backend))
def test_every_backend_has_a_builder_that_returns_an_actor(backend):
    build = builder(backend)
    returned = inspect.signature(build, eval_str=True).return_annotation
    assert inspect.isclass(returned) and issubclass(returned, Actor), (backend, returned)
    assert set(BUILDERS) == set(Backend)


@pytest.mark.parametrize("backend", list(Backend))
def test_a_backends_actor_overrides_only_the_abstract_hooks(backend):
    actor = inspect.signature(builder(backend), eval_str=True).return_annotation
    hooks = Actor.__abstractmethods__
    overridden = {name for name in vars(actor) if name in vars(Actor) and not name.startswith("_abc")
                  and not name.startswith("__")}
    assert overridden - hooks == set(), f"{actor.__name__} overrides working methods of Actor"
    assert hooks - set(dir(actor)) == set() and not inspect.isabstract(actor), f"{actor.__name__} misses hooks"
