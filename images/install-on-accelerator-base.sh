#!/bin/sh
# Install KubeRL into an accelerator base image (vLLM CUDA or vLLM-Ascend) that already has torch,
# vLLM and the device stack: constraints.txt pins the CPU torch of CI, so torch (and CUDA wheels)
# are dropped from the pins and the base image's torch stays. Run from the source dir (/src).
set -eu
grep -v -E '^(torch|nvidia-|triton)' constraints.txt > /tmp/constraints-accelerator.txt
pip install -c /tmp/constraints-accelerator.txt --no-deps .
pip install -c /tmp/constraints-accelerator.txt transformers boto3 prometheus-client aiohttp safetensors \
  pydantic pyyaml numpy
pip install "megatron-core==0.14.0"
# The operator starts containers with `python -m kuberl.…`; make sure `python` exists.
command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
rm /tmp/constraints-accelerator.txt
