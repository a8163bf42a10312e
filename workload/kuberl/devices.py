"""Where a trainer rank computes, in which dtype, and over which collective backend.

One table for operator and workload: ``DIST_BACKENDS`` maps ``spec.trainer.accelerator`` to the
torch.distributed backend (NCCL needs CUDA tensors, HCCL Ascend NPU tensors, gloo CPU tensors).
A rank takes device ``LOCAL_RANK`` of its pod's accelerators (torchrun sets it, one process per
device). ``model.dtype: auto`` computes in bfloat16 on accelerators and float32 on CPU. Weights
travel from trainer to engines as the trainer's float32 master weights (``WIRE_DTYPE``); engines
cast them to their compute dtype as they load them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .api.spec import Accelerator, ModelDtype
from .interpreter import hand_over_the_gil_often

WIRE_DTYPE = torch.float32
DIST_BACKENDS = {Accelerator.NVIDIA: "nccl", Accelerator.ASCEND: "hccl", Accelerator.CPU: "gloo"}
_DTYPES = {ModelDtype.BFLOAT16: torch.bfloat16, ModelDtype.FLOAT16: torch.float16, ModelDtype.FLOAT32: torch.float32}


def compute_dtype(setting: ModelDtype | str, accelerator: Accelerator | str) -> torch.dtype:
    """``spec.model.dtype`` resolved: auto → bfloat16 on an accelerator, float32 on CPU."""
    setting = ModelDtype(setting)
    if setting == ModelDtype.AUTO:
        return torch.float32 if Accelerator(accelerator) == Accelerator.CPU else torch.bfloat16
    return _DTYPES[setting]


def dtype_name(dtype: torch.dtype) -> str:
    """The name vLLM's ``dtype`` argument and ``from_pretrained`` take: ``torch.bfloat16`` → bfloat16."""
    return str(dtype).removeprefix("torch.")


def placed(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its parameters in ``dtype`` and its buffers in their own dtypes —
    the model ``from_pretrained(dtype=…)`` builds and FSDP2's mixed precision computes with.

    ``Module.to(dtype)`` would cast the floating buffers too, among them a rotary embedding's inverse
    frequencies f_i = θ^(−2i/d): in bfloat16 each is off by up to 2⁻⁹ of itself, so the angle p·f_i
    at position p is off by up to p·f_i·2⁻⁹ — 1.2 radians at p = 1000 and 37 at p = 32000 for
    θ = 10⁶, d = 128: the engine would sample from another policy than the one trained."""
    model = model.to(device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def accelerator_device(accelerator: Accelerator | str, local_rank: int) -> torch.device:
    """Device ``local_rank`` of this pod's accelerators (made current), or the CPU. Trainer ranks
    pass ``LOCAL_RANK``; an embedded-engine replica takes its first device."""
    kind = Accelerator(accelerator)
    if kind == Accelerator.NVIDIA:
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise SystemExit(f"spec.trainer.accelerator is nvidia but this process (LOCAL_RANK {local_rank}) sees "
                             f"{torch.cuda.device_count()} CUDA device(s): check the pod's nvidia.com/gpu request, "
                             "the node's device plugin and the image's CUDA build of torch")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == Accelerator.ASCEND:
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ImportError as err:
            raise SystemExit("spec.trainer.accelerator is ascend but torch_npu is not installed: use the "
                             "workload-ascend image") from err
        npu = torch.npu  # type: ignore[attr-defined]
        if local_rank >= npu.device_count():
            raise SystemExit(f"spec.trainer.accelerator is ascend but this process (LOCAL_RANK {local_rank}) sees "
                             f"{npu.device_count()} NPU(s): check the pod's huawei.com/Ascend910 request")
        npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def collective_device() -> torch.device:
    """Where a tensor handed to the default process group's collectives must live: the current
    accelerator for NCCL / HCCL, the CPU for gloo (or without a process group)."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def set_compute_threads(threads: int) -> None:
    """``threads`` torch threads, and the GIL handed over often (:func:`kuberl.interpreter.hand_over_the_gil_often`)."""
    torch.set_num_threads(threads)
    hand_over_the_gil_often()
