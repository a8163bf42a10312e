"""Peak host memory of writing a mixture of experts as a Hugging Face directory (what an export and a
trainer checkpoint's ``model/`` do: :func:`kuberl.models.hf_dir.write_hf_dir`), above the float32 state
it starts from, in units of the written (bfloat16) model's size.

A Qwen3-MoE shape (``--experts``, ``--top-k``, ``--layers``, ``--hidden``; ≈ 214 M parameters by
default, nearly all of them experts) is built in a fresh process; its state dict is written in
bfloat16 the way the hub lays it out (one tensor per expert: :func:`kuberl.models.file_layout.in_files`),
and the process reports its peak RSS (``ru_maxrss``) above its RSS before the write. Writing can hold
no less than the written copy (1 ×): the files' tensors are the bfloat16 casts.

    python benchmarks/export_memory.py [--experts 64] [--top-k 8] [--layers 4] [--hidden 1024]
                                       [--out benchmarks/results/export_memory.json]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_out, report

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import json, resource, sys, tempfile
from pathlib import Path
import psutil, torch
from kuberl.models.hf_dir import write_hf_dir
from kuberl.models.tiny import char_tokenizer, tiny_qwen3_moe

experts, top_k, layers, hidden = (int(a) for a in sys.argv[1:5])
tokenizer = char_tokenizer()
model = tiny_qwen3_moe(len(tokenizer), 0, hidden=hidden, layers=layers, experts=experts, top_k=top_k)
state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
parameters = sum(tensor.numel() for tensor in state.values())
start = psutil.Process().memory_info().rss
with tempfile.TemporaryDirectory() as directory:
    write_hf_dir(state, model.config, tokenizer, Path(directory), torch.bfloat16)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"parameters": parameters, "written_gb": round(parameters * 2 / 1e9, 3),
                  "peak_above_start_gb": round((peak - start) / 1e9, 3),
                  "peak_above_start_x_written": round((peak - start) / (parameters * 2), 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    add_out(parser, "export_memory")
    args = parser.parse_args()
    env_path = f"{ROOT / 'workload'}:{ROOT / 'operator'}"
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([sys.executable, "-c", MEASURE, *map(str, (args.experts, args.top_k, args.layers,
                                                                        args.hidden))],
                              capture_output=True, text=True, check=True, cwd=scratch,
                              env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"command": f"python benchmarks/export_memory.py --experts {args.experts} --top-k {args.top_k} "
                         f"--layers {args.layers} --hidden {args.hidden}", **measured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
