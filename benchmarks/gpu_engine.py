"""What one GPU can say that a CPU cannot, on a ≈ 0.4 B-parameter Qwen2 built in code (bfloat16):
the torch engine's generated tokens/s at batch 64, one FSDP2 trainer step's time and peak memory on
the rollout it generated, and a weight update's time (trainer → engine, on the same device).

    python benchmarks/gpu_engine.py [--out FILE]      # needs CUDA; JSON last line (also to FILE)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from kuberl.fsdp.actor import FSDPActor
from kuberl.inference.contract import SamplingParams
from kuberl.inference.engine import TorchEngine
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import collate
from kuberl.rollout.types import Trajectory

BATCH, PROMPT_TOKENS, NEW_TOKENS = 64, 64, 256


def model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def world_of_one(device: torch.device) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)


async def generate(engine: TorchEngine, prompts: list[list[int]]) -> tuple[list, float]:
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
        await engine.generate(prompts[0], SamplingParams(max_new_tokens=4))  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        gens = list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
        torch.cuda.synchronize()
        return gens, time.perf_counter() - started
    finally:
        await engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    world_of_one(device)
    policy = model()
    params = sum(p.numel() for p in policy.parameters())
    actor = FSDPActor.create(policy, AlgorithmConfig(name="grpo", group_size=8, kl_coef=0.0), lr=1e-6, temperature=1.0,
                         device=device, compute_dtype=torch.bfloat16)
    engine_model = model().to(device=device, dtype=torch.bfloat16)
    engine = TorchEngine(engine_model, eos_id=-1, pad_id=0, max_batch=BATCH)  # no EOS: every row writes NEW_TOKENS
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 32000, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(BATCH)]
    gens, gen_seconds = asyncio.run(generate(engine, prompts))
    tokens = sum(len(x.output_ids) for x in gens)

    trajs = [Trajectory(p, x.output_ids, x.logprobs, x.versions) for p, x in zip(prompts, gens, strict=True)]
    batch = collate(trajs, [(-1.0) ** i for i in range(BATCH)], pad_id=0, version=0)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    actor.train_step(batch, batch.size)
    torch.cuda.synchronize()
    step_seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device)

    state = actor.full_state_dict()
    torch.cuda.synchronize()
    started = time.perf_counter()
    asyncio.run(engine.load_weights(state, version=1))
    torch.cuda.synchronize()
    update_seconds = time.perf_counter() - started
    result = {"device": torch.cuda.get_device_name(0), "parameters": params, "batch": BATCH,
              "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "generated_tokens": tokens,
              "engine_tokens_per_second": round(tokens / gen_seconds, 1), "generate_seconds": round(gen_seconds, 3),
              "train_step_seconds": round(step_seconds, 3), "train_step_peak_gib": round(peak / 2**30, 2),
              "weight_update_seconds": round(update_seconds, 3)}
    dist.destroy_process_group()
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
