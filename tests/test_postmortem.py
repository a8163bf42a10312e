"""A failed experiment's post-mortem (kuberl_operator.postmortem, builders.postmortem): kept in a ConfigMap
that outlives the pods, named in status.postmortem, size-bounded, and without a credential's value."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import tarfile

import boto3
import pytest
import yaml

from kuberl.api.contract import POSTMORTEM_ARCHIVE_KEY
from kuberl_cli.main import main
from kuberl_operator.builders.postmortem import LOG_LIMIT_BYTES, archive, bounded_archive, redact

from .harness import GROUP, bind, emulated_cluster, eventually, pods, running_operator, set_pod
from .test_operator import experiment, get_rlx

S3_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzz9Xq"  # the credentials Secret's value: in no bundle
LEAKED_TOKEN = "hf_leakedTOKENvalue123"  # a line a team's code printed: blanked


def files_of(data: bytes) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name.removeprefix("postmortem/"): tar.extractfile(m).read().decode() for m in tar.getmembers()}


def test_credentials_in_a_log_line_are_blanked_and_the_rest_is_kept():
    line = (f"env HF_TOKEN={LEAKED_TOKEN} aws_secret_access_key: '{S3_SECRET}' Authorization: Bearer abc.def "
            "password=hunter2 step 7/500 reward 0.41 tokens=128")
    cleaned = redact(line)
    for value in (LEAKED_TOKEN, S3_SECRET, "abc.def", "hunter2"):
        assert value not in cleaned
    assert "step 7/500 reward 0.41" in cleaned and "HF_TOKEN=<redacted>" in cleaned
    assert redact("RuntimeError: CUDA error: out of memory") == "RuntimeError: CUDA error: out of memory"


def test_the_bundle_stays_under_its_bound_by_cutting_logs_from_their_start():
    exp = {"metadata": {"name": "big"}, "status": {"phase": "Failed"}}
    noise = "".join(f"line {i} {hashlib.sha256(str(i).encode()).hexdigest()}\n" for i in range(40_000))  # 3 MB
    logs = {"big-trainer-0/trainer": noise + "the last line: Killed\n", "big-inference-r0/inference": "ok\n"}
    data = bounded_archive(exp, [], [], logs, "Failed", "2026-11-29T00:00:00Z", limit=16 * 1024)
    assert len(data) <= 16 * 1024
    files = files_of(data)
    assert files["logs/big-trainer-0/trainer.log"].endswith("the last line: Killed\n")
    assert files["logs/big-inference-r0/inference.log"] == "ok\n"
    index = yaml.safe_load(files["index.yaml"])
    assert index["logs_cut"] == ["big-trainer-0/trainer"] and index["logs_cut_to_bytes"] < LOG_LIMIT_BYTES
    assert len(archive(exp, [], [], logs, "Failed", "2026-11-29T00:00:00Z")) > 16 * 1024  # the bound acted


@pytest.mark.integration
async def test_a_failed_experiment_leaves_a_post_mortem_the_pods_do_not_take_with_them(tmp_path, aws_env, capsys):
    """The bundle is kept in a ConfigMap owned by the experiment and named in its status; ``kuberl postmortem NAME
    --to checkpoint`` (through the API, with the reader's own storage credentials: moto here) copies it beside
    the checkpoints, byte for byte; an experiment that has not failed has none, and says why."""
    doc = experiment()
    doc["spec"]["trainer"]["backoffLimit"] = 0
    doc["spec"]["checkpoint"]["uri"] = "s3://runs/cpu-tiny/"
    doc["spec"]["storage"] = {"credentialsSecret": "s3-credentials"}
    async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
        api = cluster.api
        await api.create("", "secrets", "team-a", {"metadata": {"name": "s3-credentials"}, "stringData": {
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": S3_SECRET}})
        await api.create(GROUP, "rlexperiments", "team-a", doc)
        await eventually(lambda: len(pods(api, "team-a")) == 2, what="pods")
        [trainer] = pods(api, "team-a", "kuberl.io/role=trainer")
        [replica] = pods(api, "team-a", "kuberl.io/role=inference")
        container = trainer["spec"]["containers"][0]["name"]
        api.pod_logs.texts[("team-a", trainer["metadata"]["name"], container, False)] = (
            "step 41/500 reward 0.520\n" f"a team's reward printed HF_TOKEN={LEAKED_TOKEN}\n"
            "Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access\n")
        await bind(api, trainer, "node-a")
        await set_pod(api, trainer, "Failed", exit_code=1)
        exp = await eventually(lambda: (get_rlx(api, "cpu-tiny").get("status") or {}).get("postmortem")
                               and get_rlx(api, "cpu-tiny"), what="status.postmortem")
        kept = exp["status"]["postmortem"]
        assert exp["status"]["phase"] == "Failed" and kept["configMap"] == "cpu-tiny-postmortem", kept
        config = api.get("", "configmaps", "team-a", "cpu-tiny-postmortem")
        assert config["metadata"]["ownerReferences"][0]["uid"] == exp["metadata"]["uid"]  # goes with the experiment
        data = base64.b64decode(config["binaryData"][POSTMORTEM_ARCHIVE_KEY])
        assert len(data) == kept["bytes"] and "base64 -d | tar -xz" in kept["read"]
        files = files_of(data)
        log = files[f"logs/{trainer['metadata']['name']}/{container}.log"]
        assert "CUDA error: an illegal memory access" in log and "step 41/500" in log
        assert not any(replica["metadata"]["name"] in name for name in files)  # no log to give: left out
        conditions = yaml.safe_load(files["experiment.yaml"])["status"]["conditions"]
        assert any(c["reason"] == "PodFailed" and "exit code 1" in c["message"] for c in conditions)
        states = {p["name"]: p for p in yaml.safe_load(files["pods.yaml"])}
        terminated = states[trainer["metadata"]["name"]]["containers"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 1 and states[replica["metadata"]["name"]]["phase"] == "Pending"
        assert "s3-credentials" in files["experiment.yaml"]  # by reference
        token = base64.b64decode(api.get("", "secrets", "team-a", "cpu-tiny-api-token")["data"]["token"]).decode()
        everything = "".join(files.values())
        for value in (S3_SECRET, LEAKED_TOKEN, token):
            assert value not in everything
        events = api.list("", "events", "team-a")
        assert any(e["reason"] == "PostMortemKept" and "cpu-tiny-postmortem" in e["message"] for e in events)

        boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket="runs")
        out = tmp_path / "bundle.tar.gz"
        cli = ["postmortem", "cpu-tiny", "--api", cluster.url, "-n", "team-a", "-o", str(out), "--to", "checkpoint"]
        assert await asyncio.to_thread(main, cli) == 0
        stamp = kept["time"].replace("-", "").replace(":", "")
        stored = boto3.client("s3", endpoint_url=aws_env).get_object(
            Bucket="runs", Key=f"cpu-tiny/postmortem/{stamp}/postmortem.tar.gz")["Body"].read()
        assert out.read_bytes() == stored == data
        await api.create(GROUP, "rlexperiments", "team-a", {**experiment(), "metadata": {
            "name": "healthy", "namespace": "team-a"}})  # fmt: skip
        assert await asyncio.to_thread(main, ["postmortem", "healthy", "--api", cluster.url, "-n", "team-a",
                                              "-o", str(tmp_path / "none.tar.gz")]) == 1
        assert "has no post-mortem" in capsys.readouterr().err
