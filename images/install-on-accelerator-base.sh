#!/bin/sh
# Install KubeRL into an accelerator base image (vLLM CUDA or vLLM-Ascend) that already has torch,
# vLLM, transformers and the device stack. The base image's torch, vLLM and transformers stay (vLLM
# pins its own transformers); KubeRL itself goes in without dependencies, then the packages the base
# lacks at the versions of constraints.txt, and megatron-core at constraints.txt's version — the one
# the tests use. Run from the source dir (/src).
set -eu
grep -v -E '^(torch|nvidia-|triton|transformers|tokenizers|safetensors|huggingface-hub)' constraints.txt \
  > /tmp/constraints-accelerator.txt
pip install -c /tmp/constraints-accelerator.txt --no-deps .
pip install -c /tmp/constraints-accelerator.txt boto3 prometheus-client aiohttp pydantic pyyaml psutil wandb mlflow-skinny
pip install -c /tmp/constraints-accelerator.txt --no-deps megatron-core
# The operator starts containers with `python -m kuberl.…`; make sure `python` exists.
command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
rm /tmp/constraints-accelerator.txt
