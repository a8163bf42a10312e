"""Peak host memory of a trainer rank while it loads the policy: the whole model on every rank, then
sharded (``before``), against built on the ``meta`` device, sharded, then each rank's own shards
read from the safetensors files (``after``, what ``kuberl.trainer.loop.set_up`` does). With
``--backend megatron`` the ranks are Megatron tensor-parallel ranks: ``before`` converts the whole
HF model each rank loaded (and keeps it as the actor's twin), ``after`` reads the files a layer at
a time (:class:`kuberl.models.meta.FileState`), the twin staying on ``meta``.

A Qwen2-shaped model of ≈ 340 M parameters (``--layers``, ``--hidden``) is written once, in bfloat16
and in several safetensors files (``--shard-size``) as hub checkpoints are, to a temporary
directory; then, for each mode, 2 ranks (gloo, CPU) start as fresh processes and report their
peak RSS (``VmHWM``, which counts the pages of the safetensors files they map) and their peak
anonymous memory (``RssAnon``, sampled) after ``Actor.create``. ``baseline`` is the same processes
with the libraries imported and the process group up but no model: the fixed overhead. The whole
model's float32 size is printed beside them.

    python benchmarks/load_memory.py [--backend fsdp|megatron] [--out benchmarks/results/load_memory[_megatron].json]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("baseline", "before", "after")


def write_model(directory: Path, layers: int, hidden: int, shard_size: str) -> int:
    """A random Qwen2 model in ``directory``, in safetensors files of at most ``shard_size``; returns its
    parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shard_size)
    return sum(p.numel() for p in model.parameters())


def status_bytes(field: str) -> int:
    """A size from /proc/self/status, in bytes: ``VmHWM`` (peak resident set; of this address space,
    unlike ``ru_maxrss``, which an exec'd process inherits from its parent) or ``RssAnon``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class AnonymousPeak:
    """The largest ``RssAnon`` seen, sampled every 5 ms: the process's own memory, without the pages
    of files it maps (safetensors are read through mmap: page cache, shared by a node's ranks)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, status_bytes("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, status_bytes("RssAnon"))


def make_actor(backend: str, model: Any, config: Any, weights: Path | None) -> tuple[Any, int]:
    """(the actor of ``backend`` on ``model``, its rank's parameter count): FSDP2's shards, or Megatron
    with tensor parallelism over every rank (``weights``: a ``meta`` model's files)."""
    from kuberl.fsdp.actor import FSDPActor

    if backend == "fsdp":
        actor = FSDPActor.create(model, config, lr=1e-6, temperature=1.0, weights=weights)
        return actor, sum(p.to_local().numel() for p in actor.model.parameters())
    import torch.distributed as dist
    from megatron.core import parallel_state

    from kuberl.megatron.actor import MegatronActor

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    actor = MegatronActor.from_hf(model, config, lr=1e-6, temperature=1.0, weights=weights)
    return actor, sum(p.numel() for p in actor.model.parameters())


def rank_main(mode: str, backend: str, directory: Path, rank: int, world: int, port: int) -> dict[str, Any]:
    """One rank: the process group, then (unless ``baseline``) the actor as ``mode`` loads it."""
    import os

    import torch.distributed as dist

    from kuberl.api.spec import ModelSource
    from kuberl.models.loading import load_model, load_skeleton
    from kuberl.policy.algorithms import AlgorithmConfig
    from kuberl.settings import Settings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    anonymous = AnonymousPeak()
    source, settings = ModelSource(path=f"file://{directory}"), Settings()
    config = AlgorithmConfig(name="grpo", group_size=8)
    local = 0
    if mode == "before":
        model, _ = load_model(source, 0, settings)
        _, local = make_actor(backend, model, config, None)
    elif mode == "after":
        model, _, weights = load_skeleton(source, 0, settings)
        _, local = make_actor(backend, model, config, weights)
    dist.barrier()
    peak, peak_anonymous = status_bytes("VmHWM"), anonymous.stop()
    dist.destroy_process_group()
    return {"rank": rank, "peak_rss_bytes": peak, "peak_anonymous_bytes": peak_anonymous, "local_parameters": local}


def measure(mode: str, backend: str, directory: Path, world: int) -> list[dict[str, Any]]:
    from kuberl.local.processes import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--mode", mode,
                               "--backend", backend, "--dir", str(directory), "--port", str(port)],
                              stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"rank failed in mode {mode} (exit {proc.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shard-size", default="150MB", help="the largest safetensors file (hub checkpoints come in "
                        "several: Qwen3-8B in 5 of ≈ 3.3 GB, a fifth of the model each; 150MB is that here)")
    parser.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp",
                        help="megatron: tensor parallelism over the ranks")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/load_memory[_megatron].json")
    parser.add_argument("--rank", type=int), parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--dir", type=Path), parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.rank is not None:  # one rank of one measurement
        print(json.dumps(rank_main(args.mode, args.backend, args.dir, args.rank, args.world, args.port)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        parameters = write_model(Path(tmp), args.layers, args.hidden, args.shard_size)
        files = len(list(Path(tmp).glob("*.safetensors")))
        runs = {mode: measure(mode, args.backend, Path(tmp), args.world) for mode in MODES}
    gib = 1024**3
    fp32 = parameters * 4
    result: dict[str, Any] = {"backend": args.backend, "parameters": parameters, "model_fp32_gib": round(fp32 / gib, 3),
                              "ranks": args.world, "safetensors_files": files}
    for mode, ranks in runs.items():
        result[f"{mode}_peak_rss_gib"] = [round(r["peak_rss_bytes"] / gib, 3) for r in ranks]
        result[f"{mode}_peak_anonymous_gib"] = [round(r["peak_anonymous_bytes"] / gib, 3) for r in ranks]
    for memory in ("rss", "anonymous"):
        overhead = max(r[f"peak_{memory}_bytes"] for r in runs["baseline"])
        for mode in ("before", "after"):
            worst = max(r[f"peak_{memory}_bytes"] for r in runs[mode])
            result[f"{mode}_{memory}_over_baseline_vs_model_fp32"] = round((worst - overhead) / fp32, 3)
    result["local_parameters_after"] = [r["local_parameters"] for r in runs["after"]]
    for key, value in result.items():
        print(f"{key}: {value}")
    suffix = "" if args.backend == "fsdp" else f"_{args.backend}"
    (args.out or ROOT / f"benchmarks/results/load_memory{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
