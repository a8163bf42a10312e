"""hf:// models through ``huggingface_hub`` against a hub on loopback (tests/hub_server.py): the
snapshot lands in the node cache under its commit, only what from_pretrained reads is fetched, a
gated model needs the token, a missing one fails naming the field, and a second load needs no hub."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kuberl.api.spec import ModelSource
from kuberl.local.processes import free_port
from kuberl.models.hub import parse_hub_path, resolved_revision
from kuberl.models.loading import ModelLoadError, load_model, model_origin
from kuberl.settings import Settings

from .hf_model import write_hf_model
from .hub_server import COMMIT, FakeHub, Repo, start


@pytest.fixture
def hub(tmp_path: Path):
    model_dir = write_hf_model(tmp_path / "repo")
    (model_dir / "pytorch_model.bin").write_bytes(b"a second copy of the weights, never fetched")
    hub = FakeHub({"team/tiny-chat": Repo(model_dir), "team/gated": Repo(model_dir, token="hf_secret_token")})
    port = free_port()
    stop = start(hub, port)
    yield hub, f"http://127.0.0.1:{port}", model_dir
    stop()


def test_a_hub_model_loads_into_the_cache_under_its_commit_and_equals_the_repository(hub, tmp_path):
    fake, endpoint, model_dir = hub
    settings = Settings(cache_dir=tmp_path / "cache", hub_endpoint=endpoint)
    source = ModelSource(path="hf://team/tiny-chat@main")
    model, tokenizer = load_model(source, seed=0, settings=settings)
    local = Path(tokenizer.name_or_path)
    assert local.parent.name == "snapshots" and resolved_revision(local) == COMMIT
    assert local.is_relative_to(settings.cache_dir / "hub")
    assert model_origin(source, tokenizer) == {"path": "hf://team/tiny-chat@main", "revision": COMMIT,
                                               "init_from": None}
    from safetensors.torch import load_file

    want = load_file(model_dir / "model.safetensors")
    got = model.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    assert tokenizer.chat_template and tokenizer("3+4=").input_ids
    assert not any(p.endswith("pytorch_model.bin") for p in fake.requested)  # only what from_pretrained reads
    asked = len(fake.requested)
    load_model(ModelSource(path=f"hf://team/tiny-chat@{COMMIT}"), seed=0, settings=settings)
    assert len(fake.requested) == asked  # a commit is immutable: the cached snapshot, no request


def test_a_gated_model_needs_the_token_and_a_missing_one_names_the_field(hub, tmp_path):
    _, endpoint, _ = hub
    settings = Settings(cache_dir=tmp_path / "cache", hub_endpoint=endpoint)
    with pytest.raises(ModelLoadError, match=r"spec\.model\.path 'hf://team/nope': no such repository"):
        load_model(ModelSource(path="hf://team/nope"), seed=0, settings=settings)
    with pytest.raises(ModelLoadError, match=r"spec\.model\.path 'hf://team/gated'"):
        load_model(ModelSource(path="hf://team/gated"), seed=0, settings=settings)
    with_token = Settings(cache_dir=tmp_path / "cache", hub_endpoint=endpoint, hub_token="hf_secret_token")
    _, tokenizer = load_model(ModelSource(path="hf://team/gated"), seed=0, settings=with_token)
    assert resolved_revision(Path(tokenizer.name_or_path)) == COMMIT


def test_hub_paths_parse_with_and_without_a_revision():
    assert parse_hub_path("hf://Qwen/Qwen3-8B") is not None
    model = parse_hub_path("hf://Qwen/Qwen3-8B@refs/pr/1")
    assert model is not None and (model.repo, model.revision) == ("Qwen/Qwen3-8B", "refs/pr/1")
    assert parse_hub_path("s3://bucket/model/") is None


@pytest.mark.slow
def test_a_hub_dataset_in_verls_format_streams_its_rows(tmp_path):
    """hf://datasets/ORG/NAME through the ``datasets`` library, in a process whose HF_ENDPOINT names the
    hub (as the operator sets it in pods from spec.storage.hubEndpoint; the libraries read it once)."""
    import json
    import os
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "dataset" / "data"
    repo.mkdir(parents=True)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)},
             "extra_info": {"index": i}} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), repo / "train-00000-of-00001.parquet")
    hub = FakeHub({"team/math": Repo(repo.parent, kind="datasets")})
    port = free_port()
    stop = start(hub, port)
    script = (
        "import itertools, json, pathlib\n"
        "from kuberl.api.spec import DatasetSource\n"
        "from kuberl.data.datasets import examples\n"
        "from kuberl.settings import from_environment\n"
        "source = DatasetSource(path='hf://datasets/team/math', answerKey='reward_model.ground_truth')\n"
        "got = list(itertools.islice(examples(source, 0, settings=from_environment()), 10))\n"
        "print(json.dumps([[e.prompt[0]['content'], e.answer, e.row['extra_info']['index']] for e in got]))\n")
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "KUBERL_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HOME": str(tmp_path / "hf-home")}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop()
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(got, key=lambda r: r[2]) == [[f"{i}+1=", str(i + 1), i] for i in range(10)]
    assert any(p.startswith("/api/datasets/team/math") for p in hub.requested)


def test_kuberl_validate_reads_a_hub_models_config_alone_and_refuses_what_it_cannot_train(hub, tmp_path, capsys,
                                                                                        monkeypatch):
    """Before any pod starts: ``kuberl validate`` fetches the hub model's config.json — nothing else of it —
    and refuses routing replay on this dense model, naming the field; a hub it cannot reach leaves the check
    to the trainer, with a warning, and the manifest valid."""
    import yaml

    from kuberl.api.contract import ENV_CACHE_DIR
    from kuberl_cli.main import main

    from .conftest import MINIMAL

    fake, endpoint, _ = hub
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "cache"))
    doc = MINIMAL | {"spec": MINIMAL["spec"] | {"model": {"path": "hf://team/tiny-chat"},
                                                "algorithm": {"routingReplay": True},
                                                "storage": {"hubEndpoint": endpoint}}}
    manifest = tmp_path / "x.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(manifest)]) == 1
    err = capsys.readouterr().err
    assert "spec.algorithm.routingReplay: is true but hf://team/tiny-chat has no mixture-of-experts router" in err
    assert fake.requested and all(p.endswith("/config.json") for p in fake.requested if "/resolve/" in p)
    assert not any(p.endswith(".safetensors") for p in fake.requested)

    doc["spec"]["algorithm"] = {}
    doc["spec"]["storage"] = {"hubEndpoint": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "empty-cache"))  # (a cached config.json would be read)
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(manifest)]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "spec.model.path: model checks skipped" in err


def test_kuberl_validate_sends_no_credential_to_a_hub_the_manifest_names(hub, tmp_path, monkeypatch):
    """Issue 69, item 4: a CI job validating pull requests must not hand its HF_TOKEN (or its saved
    login) to whatever ``spec.storage.hubEndpoint`` a pull request names. The manifest-named hub gets
    no Authorization header at all; huggingface.co's own address is the only one a saved login goes to."""
    import yaml

    from kuberl.api.contract import ENV_CACHE_DIR
    from kuberl.settings import hub_token
    from kuberl_cli.main import main

    from .conftest import MINIMAL

    fake, endpoint, _ = hub
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_the_validators_own_token")
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_the_validators_saved_login")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    doc = MINIMAL | {"spec": MINIMAL["spec"] | {"model": {"path": "hf://team/tiny-chat"},
                                                "storage": {"hubEndpoint": endpoint}}}
    manifest = tmp_path / "x.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(manifest)]) == 0
    assert any(p.endswith("/config.json") for p in fake.requested)  # it did ask that hub
    assert fake.authorizations == []
    assert hub_token(Settings(hub_endpoint=endpoint)) is False  # no implicit login to a mirror
    assert hub_token(Settings()) is None  # huggingface.co: the library's own lookup
    assert hub_token(Settings(hub_token="given", hub_endpoint=endpoint)) == "given"  # the run's own Secret


@pytest.mark.parametrize("path", ["hf://team/tiny-chat@../../etc", "hf://team/tiny-chat@main/../x",
                                  "hf://team/tiny-chat@a..b"])
def test_a_hub_revision_with_dot_dot_is_refused_naming_the_field(path):
    from kuberl.api import validate_document

    from .conftest import MINIMAL

    _, issues = validate_document(MINIMAL | {"spec": MINIMAL["spec"] | {"model": {"path": path}}})
    assert [i.path for i in issues] == ["spec.model.path"] and "'..'" in issues[0].message, issues
    data = {"path": "hf://datasets/team/math", "revision": "../main"}
    _, issues = validate_document(MINIMAL | {"spec": MINIMAL["spec"] | {"dataset": data}})
    assert [i.path for i in issues] == ["spec.dataset.revision"], issues
