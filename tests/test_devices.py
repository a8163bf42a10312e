"""Device placement and dtype without an accelerator.

A trainer rank on a GPU or NPU fails at its first micro-batch when any tensor of the step stays on
the CPU (NCCL and HCCL refuse CPU tensors too). Here the actor's whole train step runs with the
model on PyTorch's ``meta`` device under a mode that refuses any op mixing devices (0-dim CPU
scalars aside, as CUDA allows) — stricter than meta itself, which lets an embedding or gather take
CPU indices. The step runs unsharded: FSDP2 refuses to train meta parameters, and sharding does not
move batch tensors. Breaking the placement (e.g. not moving the micro-batches in
``Actor.train_step``) makes these tests fail.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from kuberl.api.spec import Accelerator, ModelDtype
from kuberl.devices import DIST_BACKENDS, accelerator_device, collective_device, compute_dtype, dtype_name
from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import tiny_qwen2
from kuberl.policy.actor import Actor
from kuberl.policy.batch import collate

from .test_actor import CONFIG, trajectories


class OneDevicePerOp(TorchFunctionMode):
    """Raise when an op's tensor arguments live on more than one device."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        devices = {t.device for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise AssertionError(f"{getattr(func, '__name__', func)} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def meta_actor(kl_coef: float = 0.0, mini_batches: int = 1) -> Actor:
    with torch.device("meta"):
        model = tiny_qwen2(40, seed=3)
    # sdpa's mask builder asks whether the padding mask is all ones (a data-dependent .item()),
    # which meta tensors cannot answer; the eager mask is built from the same inputs without it
    model.config._attn_implementation = "eager"
    config = replace(CONFIG, kl_coef=kl_coef)
    reference = copy.deepcopy(model).requires_grad_(False).eval() if kl_coef else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return FSDPActor(model.train(), optimizer, config, 1.0, mini_batches, reference=reference,
                 device=torch.device("meta"))


@pytest.mark.parametrize(("kl_coef", "mini_batches"), [(0.0, 1), (0.04, 1), (0.0, 2)])
def test_a_train_step_keeps_every_tensor_on_the_models_device(kl_coef, mini_batches):
    actor = meta_actor(kl_coef, mini_batches)
    trajs, advs = trajectories(6)
    batch = collate(trajs, advs, 0, version=0)  # built in host memory, as the trainer does
    with OneDevicePerOp():
        stats = actor.train_step(batch, len(trajs))
    assert "ppo_actor/loss" in stats and "mismatch/behav_logp_gap" in stats


def test_the_strict_mode_catches_a_cpu_tensor_meta_alone_would_accept():
    weight = torch.zeros(4, 3, device="meta")
    torch.nn.functional.embedding(torch.tensor([1, 2]), weight)  # meta lets this through
    with OneDevicePerOp(), pytest.raises(AssertionError, match="mixes devices"):
        torch.nn.functional.embedding(torch.tensor([1, 2]), weight)


def test_backend_dtype_and_device_rules():
    assert DIST_BACKENDS == {Accelerator.NVIDIA: "nccl", Accelerator.ASCEND: "hccl", Accelerator.CPU: "gloo"}
    assert compute_dtype(ModelDtype.AUTO, "cpu") == torch.float32
    assert compute_dtype("auto", "nvidia") == compute_dtype("auto", "ascend") == torch.bfloat16
    assert compute_dtype("float16", "ascend") == torch.float16 and dtype_name(torch.bfloat16) == "bfloat16"
    assert accelerator_device("cpu", 3) == torch.device("cpu")
    assert collective_device() == torch.device("cpu")  # no process group: gloo semantics


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_an_nvidia_trainer_without_a_visible_gpu_stops_with_a_message():
    with pytest.raises(SystemExit, match="sees 0 CUDA device"):
        accelerator_device("nvidia", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_a_train_step_on_a_gpu_in_bfloat16():
    device = accelerator_device("nvidia", 0)
    actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0, device=device,
                         compute_dtype=torch.bfloat16)
    trajs, advs = trajectories(6)
    stats = actor.train_step(collate(trajs, advs, 0, version=0), len(trajs))
    assert stats["ppo_actor/loss"] == stats["ppo_actor/loss"]  # a number, not NaN
