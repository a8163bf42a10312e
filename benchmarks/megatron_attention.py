"""Memory and time of a Megatron-core forward and backward against the row length: the trainer's core
attention (torch's scaled dot-product attention, :mod:`kuberl.megatron.attention`) against megatron-core's
local ``DotProductAttention``, which it replaced.

A Qwen3-shaped dense model (``--layers``, ``--hidden``, ``--heads`` of size 64) computes in bfloat16
the log-probs of one row of each length in ``--lengths`` and back-propagates their sum, as a train
step does (no optimizer). Each (attention, length) runs in a fresh process, which reports its peak
RSS (``VmHWM``) above its RSS just before the forward — the forward's and backward's own memory, the
attention's scores among it — and the seconds the forward and backward took (best of ``--repeats``).

    python benchmarks/megatron_attention.py [--lengths 1024 2048 4096] [--layers 2] [--hidden 512] [--heads 8]
                                            [--repeats 2] [--out benchmarks/results/megatron_attention.json]

Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ATTENTIONS = ("sdpa", "megatron")


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(attention: str, length: int, layers: int, hidden: int, heads: int, repeats: int) -> dict[str, Any]:
    """In this process: the model built with ``attention``, one row of ``length`` forward and backward."""
    sys.path[:0] = [str(ROOT / "workload")]
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from transformers import Qwen3Config

    from kuberl.megatron import layer_spec, model
    from kuberl.megatron.attention import sdpa_attention
    from kuberl.megatron.cpu import cpu_shim
    from kuberl.megatron.logprobs import token_logprobs_and_entropy
    from kuberl.policy.batch import collate
    from kuberl.rollout.types import Trajectory

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    config = Qwen3Config(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                         max_position_embeddings=length + 1)  # fmt: skip
    if attention == "megatron":  # the core attention megatron-core's local spec has
        class MegatronsOwn(DotProductAttention):  # type: ignore[misc]
            def forward(self, query: Any, key: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
                if mask is None:  # megatron-core would build its causal mask on a CUDA device
                    mask = torch.ones(query.shape[0], key.shape[0], dtype=torch.bool).triu(1)[None, None]
                return super().forward(query, key, value, mask, *args, **kwargs)

        built = model.block_spec
        model.block_spec = lambda c: layer_spec.replaced(built(c), {sdpa_attention(): MegatronsOwn})
    with cpu_shim():
        gpt = model.build_gpt_model(config, compute_dtype=torch.bfloat16)
        ids = torch.randint(3, config.vocab_size, (length,)).tolist()
        batch = collate([Trajectory(ids[:8], ids[8:], [0.0] * (length - 8), [0] * (length - 8))], [1.0], 0, 0)
        before, seconds = rss_kib("VmRSS"), []
        for _ in range(repeats):
            start = time.perf_counter()
            logp, _ = token_logprobs_and_entropy(gpt, batch, 1.0, torch.bfloat16)
            logp.sum().backward()
            seconds.append(time.perf_counter() - start)
    return {"attention": attention, "length": length, "peak_above_start_mib": round((rss_kib("VmHWM") - before) / 1024),
            "seconds": round(min(seconds), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("ATTENTION", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.layers, args.hidden, args.heads, args.repeats)))
        return
    runs = []
    for length in args.lengths:
        for attention in ATTENTIONS:
            shape = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
                     "--repeats", str(args.repeats)]
            done = subprocess.run([sys.executable, __file__, "--one", attention, str(length), *shape],
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.splitlines()[-1]))
            print(runs[-1], file=sys.stderr)
    result = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "dtype": "bfloat16", "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
