"""The README's path on a cluster, on one machine: a manifest shaped like the README's (model and
dataset at s3://, credentials in a Secret, checkpoints at s3://) through the real kubectl, the
operator and the kubelet stand-in, against moto's S3 server. The pods' env is built by the
kubelet from the pod spec only, so the workload can reach the bucket only through the Secret
that the scenario creates. Mid-run the trainer pod is deleted (its /tmp goes with it); the new
pod resumes from the S3 checkpoint and the experiment Succeeds with a better reward than at the
start."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import boto3
import pytest
import yaml
from e2e import scenario
from moto.server import ThreadedMotoServer

from kuberl.local.processes import free_port
from kuberl.models.tiny import char_tokenizer, tiny_qwen2

from .harness import emulated_cluster, running_operator
from .test_e2e import host_node, kubectl_for, kubelet_stand_in  # noqa: F401 (host_node: a fixture)
from .test_e2e import pytestmark as e2e_marks

pytestmark = e2e_marks
STEPS, DELETE_AFTER_CHECKPOINT = 80, 20
KEYS = {"AWS_ACCESS_KEY_ID": "e2e-key", "AWS_SECRET_ACCESS_KEY": "e2e-secret"}


def populate(endpoint: str, tmp_path: Path) -> None:
    """An HF-format model (the builtin tiny model's architecture and tokenizer, saved to files) and
    a JSONL dataset of the same single-digit additions."""
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"], aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])
    for bucket in ("models", "datasets", "ckpt"):
        s3.create_bucket(Bucket=bucket)
    model_dir = tmp_path / "model"
    tokenizer = char_tokenizer()
    tiny_qwen2(len(tokenizer), seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for path in model_dir.iterdir():
        s3.upload_file(str(path), "models", f"tiny/{path.name}")
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    s3.put_object(Bucket="datasets", Key="arith/train.jsonl", Body="\n".join(map(json.dumps, rows)).encode())


def manifest(path: Path, endpoint: str) -> tuple[Path, str]:
    path, name = scenario.manifest(path, STEPS)
    docs = list(yaml.safe_load_all(path.read_text()))
    spec = docs[0]["spec"]
    spec["model"]["path"] = "s3://models/tiny/"
    spec["dataset"] = {"path": "s3://datasets/arith/train.jsonl", "promptKey": "question", "answerKey": "answer"}
    spec["checkpoint"] = {"uri": "s3://ckpt/cpu-tiny/", "everySteps": 10, "keep": 2}
    spec["storage"] = {"credentialsSecret": "s3-credentials", "endpoint": endpoint, "region": "us-east-1",
                       "allowInsecureEndpoint": True}  # moto on loopback: as an in-cluster MinIO without TLS
    path.write_text(yaml.safe_dump_all(docs))
    return path, name


@pytest.mark.usefixtures("host_node")
@pytest.mark.slow
async def test_s3_model_data_and_checkpoints_survive_a_deleted_trainer_pod(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERL_PROGRESS_SECONDS", "1")
    for key in (*KEYS, "AWS_SESSION_TOKEN", "AWS_PROFILE", "KUBERL_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)  # nothing may reach the pods but the Secret
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        populate(endpoint, tmp_path)
        async with emulated_cluster(tmp_path) as cluster, running_operator(cluster):
            with kubelet_stand_in(cluster, tmp_path) as node_dir:
                kubectl = kubectl_for(cluster)
                secret = tmp_path / "secret.yaml"
                secret.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                                  "metadata": {"name": "s3-credentials"}, "stringData": KEYS}))
                await asyncio.to_thread(kubectl, "create", "--validate=false", "-f", str(secret))
                path, name = manifest(tmp_path / "experiment.yaml", endpoint)
                deleted: list[int] = []
                lines: list[str] = []

                def delete_trainer_once(status: dict[str, object]) -> None:
                    progress = status.get("progress") or {}
                    assert isinstance(progress, dict)
                    if not deleted and progress.get("lastCheckpoint") and (progress.get("step") or 0) >= \
                            DELETE_AFTER_CHECKPOINT:
                        deleted.append(int(progress["step"]))
                        lines.append(f"deleting the trainer pod at step {progress['step']}")
                        kubectl("delete", "pod", f"{name}-trainer-n0", "--wait=false")

                outcome = await asyncio.to_thread(scenario.run, kubectl, path, name, 600, lines.append,
                                                  delete_trainer_once)  # fmt: skip
    finally:
        moto.stop()
    logs = {p.parent.name: p.read_text(errors="replace") for p in sorted(node_dir.glob("pods/*/container.log"))}
    report = "\n".join(lines) + "\n--- logs ---\n" + "\n".join(t[-2500:] for t in logs.values())
    assert deleted, f"the trainer never reported a checkpoint past step {DELETE_AFTER_CHECKPOINT}\n{report}"
    assert outcome.phase == "Succeeded" and outcome.progress.get("step") == STEPS, report
    trainer_logs = [t for t in logs.values() if "kuberl.trainer" in t or "trainer INFO" in t]
    resumed = [re.search(r"resumed from the checkpoint of step (\d+)", t) for t in trainer_logs]
    resumed_at = [int(m.group(1)) for m in resumed if m]
    # one replacement pod resumed, from S3 (its /tmp was new), and trained the remaining steps
    assert len(resumed_at) == 1 and DELETE_AFTER_CHECKPOINT - 10 <= resumed_at[0] < STEPS, report
    assert any("downloading s3://models/tiny/" in t for t in trainer_logs), report
    # the first pod's own per-step log (status.progress.rewardFirst10 is the resumed pod's; kubectl get may
    # first show a reward after step 10 on a fast host)
    logged = {int(m.group(1)): float(m.group(2)) for t in trainer_logs
              for m in re.finditer(r"step (\d+)/\d+ reward ([\d.]+)", t)}  # fmt: skip
    early = [logged[s] for s in range(1, 11) if s in logged]
    final = outcome.progress.get("rewardLast10")
    assert early and isinstance(final, float) and final > sum(early) / len(early), report
    assert "e2e-secret" not in kubectl_free_text(tmp_path), "the secret value leaked into a log"
    assert outcome.leftover_pods == [], report


def kubectl_free_text(tmp_path: Path) -> str:
    """Every log the node and the pods wrote."""
    return "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
