"""s3:// models and datasets on a real HTTP S3 (moto's server, through boto3): a Hugging Face model
prefix and a JSONL dataset load from the node-local cache with the same outputs as the originals,
are downloaded once even when several processes start together, and are refetched when the bucket
changes; hostile keys and missing objects give errors that name the URI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import torch

from kuberl.api.spec import DatasetSource, ModelSource
from kuberl.data.datasets import DatasetError, examples
from kuberl.models.loading import ModelLoadError, load_model
from kuberl.remote import COMPLETE_SUFFIX, RemoteError, local_copy
from kuberl.settings import Settings

from .hf_model import write_hf_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def settings(aws_env, tmp_path) -> Settings:
    """A pod's settings: the node-local cache and the S3-compatible endpoint (moto)."""
    return Settings(cache_dir=tmp_path / "cache", s3_endpoint=aws_env)


@pytest.fixture
def bucket(aws_env, request) -> str:
    name = f"r-{request.node.name.lower().replace('_', '-')}"[:50].strip("-")
    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket=name)
    return name


def upload_dir(bucket: str, directory: Path, prefix: str) -> None:
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    for path in sorted(directory.iterdir()):
        s3.upload_file(str(path), bucket, prefix + path.name)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_s3_model_prefix_loads_with_the_same_outputs_and_chat_template(bucket, settings, tmp_path, tied):
    original_dir = write_hf_model(tmp_path / "model", tied=tied)
    upload_dir(bucket, original_dir, "models/tiny/")
    model, tokenizer = load_model(ModelSource(path=f"s3://{bucket}/models/tiny/"), 0, settings)
    reference, reference_tok = load_model(ModelSource(path=f"file://{original_dir}"), seed=0)
    ids = torch.tensor([tokenizer("12+7=19").input_ids])
    assert ids.tolist() == [reference_tok("12+7=19").input_ids]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert chat.endswith("<|im_start|>assistant\n")
    cached = tmp_path / "cache" / "s3" / bucket / "models" / "tiny"
    assert (cached / "model.safetensors").is_file() and Path(f"{cached}{COMPLETE_SUFFIX}").is_file()


def test_an_s3_jsonl_dataset_streams_its_rows(bucket, settings):
    rows = [{"question": f"{a}+1=", "answer": str(a + 1)} for a in range(5)]
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]).put_object(
        Bucket=bucket, Key="data/train.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
    stream = examples(DatasetSource(path=f"s3://{bucket}/data/train.jsonl", prompt_key="question",
                                    answer_key="answer"), 1, 0, settings)  # fmt: skip
    seen = {next(stream) for _ in range(5)}
    assert {(e.prompt, e.answer) for e in seen} == {(r["question"], r["answer"]) for r in rows}


DOWNLOADER = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pathlib import Path
from kuberl.remote import local_copy
from kuberl.settings import Settings
print(local_copy(sys.argv[1], Settings(cache_dir=Path(sys.argv[2]), s3_endpoint=sys.argv[3])))
"""


@pytest.mark.slow
def test_several_processes_starting_together_download_once(bucket, settings, tmp_path):
    upload_dir(bucket, write_hf_model(tmp_path / "model"), "m/")
    procs = [subprocess.Popen([sys.executable, "-c", DOWNLOADER, f"s3://{bucket}/m/", str(settings.cache_dir),
                               str(settings.s3_endpoint)], env=os.environ.copy(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({stdout.strip() for stdout, _ in outs}) == 1
    assert sum(stderr.count("downloading s3://") for _, stderr in outs) == 1, [e for _, e in outs]


def test_a_changed_object_is_fetched_again_and_a_stale_copy_never_served(bucket, settings):
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    s3.put_object(Bucket=bucket, Key="d/train.jsonl", Body=b'{"prompt": "a", "answer": "1"}')
    first = local_copy(f"s3://{bucket}/d/train.jsonl", settings)
    assert first.read_text().endswith('"1"}')
    s3.put_object(Bucket=bucket, Key="d/train.jsonl", Body=b'{"prompt": "a", "answer": "22"}')
    assert local_copy(f"s3://{bucket}/d/train.jsonl", settings).read_text().endswith('"22"}')


def test_hostile_keys_and_missing_objects_are_refused_naming_the_uri(bucket, settings):
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    s3.put_object(Bucket=bucket, Key="evil/../../escape.txt", Body=b"x")
    with pytest.raises(RemoteError, match="cannot be stored below"):
        local_copy(f"s3://{bucket}/evil/", settings)
    with pytest.raises(ModelLoadError, match=rf"spec.model.path: s3://{bucket}/nothing/: no such objects"):
        load_model(ModelSource(path=f"s3://{bucket}/nothing/"), 0, settings)
    with pytest.raises(DatasetError, match=rf"spec.dataset.path: s3://{bucket}/none.jsonl: no such object"):
        next(examples(DatasetSource(path=f"s3://{bucket}/none.jsonl"), 0, 0, settings))
