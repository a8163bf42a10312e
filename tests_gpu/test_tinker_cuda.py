"""The Tinker front door on one GPU: the base in bfloat16 on the device, a LoRA client's adapter trained in
float32 on it, and a sampler of the snapshot serving the trained policy (its prompt log-probs = the training
model's, within bfloat16's rounding). Skipped without CUDA (conftest); on the CPU, in float32, the same
steps give a gap of exactly 0 and the learnt sequence."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from kuberl.api.spec import Accelerator, ModelSource
from kuberl.settings import DEFAULTS
from kuberl.tinker.sampler import SampleParams, Sampler
from kuberl.tinker.serve import served_model
from kuberl.tinker.trainee import AdapterShape, Trainee
from kuberl.tinker.wire import DatumIn, ForwardBackwardCall

from .conftest import report

SEQUENCE = [5, 9, 14, 20, 27, 35, 44]
GAP_BOUND = 0.05  # |sampler − trainer| log-prob per token, bfloat16 base both sides


def train_and_serve(accelerator: Accelerator) -> dict[str, float]:
    served = served_model(ModelSource(path="builtin:tiny-qwen2"), 0, DEFAULTS, accelerator)
    trainee = Trainee(served.module, AdapterShape(8, seed=0), served.pad_id)
    call = ForwardBackwardCall("m", 1, "cross_entropy", [DatumIn(SEQUENCE[:-1], {
        "target_tokens": np.array(SEQUENCE[1:]), "weights": np.ones(len(SEQUENCE) - 1, dtype=np.float32)})])
    losses = []
    for _ in range(20):
        losses.append(trainee.forward_backward(call)[1]["loss:sum"])
        trainee.optim_step(5e-3, 0.9, 0.95, 1e-12, 0.0, 0.0)
    trained = trainee.forward_backward(dataclasses.replace(call, forward_only=True))[0][0]["logprobs"]

    async def serve() -> tuple[list[float], list[int]]:
        sampler = Sampler.of_weights(served.module, trainee.adapter, trainee.weights(), eos_id=served.eos_id,
                                     pad_id=served.pad_id, decode=served.decode, seed=0, base_model="b",
                                     model_path=None)
        sampler.start()
        try:
            scored = await sampler.prompt_logprobs(SEQUENCE)
            (greedy,) = await sampler.sample(SEQUENCE[:3], 1, SampleParams(max_tokens=4, temperature=0.0))
            return scored[1:], greedy.tokens
        finally:
            await sampler.stop()

    served_logprobs, greedy = asyncio.run(serve())
    return {"first_loss": losses[0], "last_loss": losses[-1], "greedy_ok": float(greedy == SEQUENCE[3:7]),
            "gap_max": float(np.abs(np.array(served_logprobs) - trained).max())}


def test_a_lora_client_trains_on_the_gpu_and_its_sampler_serves_what_it_trained() -> None:
    numbers = train_and_serve(Accelerator.NVIDIA)
    report(tinker_cuda=numbers)
    assert numbers["last_loss"] < numbers["first_loss"] / 5
    assert numbers["gap_max"] < GAP_BOUND
    assert numbers["greedy_ok"] == 1.0

