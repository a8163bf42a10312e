"""The checkpoint store on a real HTTP S3 (moto's server, boto3) and on a directory: round trip with
checksums, manifest-last (a killed upload is never used), pruning, corruption, S3 unreachable."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuberl.checkpoint import CheckpointError, CheckpointManager, ForeignCheckpoint, open_store
from kuberl.checkpoint.manager import step_dir
from kuberl.local.processes import free_port


def staging(tmp_path: Path, step: int, big: bool = False) -> Path:
    root = tmp_path / f"stage-{step}"
    (root / "model").mkdir(parents=True)
    (root / "model" / "shard-0.bin").write_bytes(bytes([step % 256]) * ((20 << 20) if big else 1000))
    (root / "trainer_state.json").write_text(f'{{"step": {step}}}')
    return root


def test_round_trip_with_checksums(uri, tmp_path):
    manager = CheckpointManager(open_store(uri), keep=3)
    assert manager.latest() is None
    saved = manager.save(staging(tmp_path, 10, big=True), 10, {"version": 10})
    assert saved == uri + step_dir(10)
    latest = manager.latest()
    assert latest is not None and latest.step == 10 and latest.meta == {"version": 10}
    out = manager.restore(latest, tmp_path / "restored")
    assert (out / "model" / "shard-0.bin").read_bytes() == (tmp_path / "stage-10/model/shard-0.bin").read_bytes()
    assert (out / "trainer_state.json").read_text() == '{"step": 10}'


def test_killed_upload_is_never_used_and_keep_prunes_only_behind_complete(uri, tmp_path, caplog):
    manager = CheckpointManager(open_store(uri), keep=2)
    for step in (10, 20):
        manager.save(staging(tmp_path, step), step)
    # a writer killed after its files but before its manifest:
    store = manager.store
    store.upload(staging(tmp_path, 30) / "trainer_state.json", step_dir(30) + "trainer_state.json")
    with caplog.at_level(logging.WARNING, logger="kuberl.checkpoint"):
        assert manager.latest().step == 20
    assert f"{uri}{step_dir(30)}" in caplog.text and "incomplete" in caplog.text
    manager.save(staging(tmp_path, 40), 40)
    steps = {k.split("/")[0] for k in store.list()}
    assert steps == {"step-00000020", "step-00000040"}  # 10 and the abandoned 30 pruned, 2 kept


def test_corrupt_or_truncated_checkpoints_are_skipped(uri, tmp_path, caplog):
    manager = CheckpointManager(open_store(uri), keep=5)
    manager.save(staging(tmp_path, 1), 1)
    manager.save(staging(tmp_path, 2), 2)
    manager.store.write_text(step_dir(2) + "MANIFEST.json", "{not json")
    with caplog.at_level(logging.WARNING, logger="kuberl.checkpoint"):
        assert manager.latest().step == 1
    assert "unreadable" in caplog.text
    manager.save(staging(tmp_path, 3), 3)
    manager.store.upload(tmp_path / "stage-3/trainer_state.json", step_dir(3) + "model/shard-0.bin")  # truncated
    assert manager.latest().step == 1


def test_checksum_mismatch_on_restore(tmp_path):
    manager = CheckpointManager(open_store(f"file://{tmp_path}/c/"))
    manager.save(staging(tmp_path, 5), 5)
    shard = tmp_path / "c" / step_dir(5) / "model/shard-0.bin"
    shard.write_bytes(b"\x07" * shard.stat().st_size)  # same size, other bytes
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        manager.restore(manager.latest(), tmp_path / "out")


def test_a_restore_that_fails_verification_falls_back_to_the_previous_checkpoint(uri, tmp_path, caplog):
    manager = CheckpointManager(open_store(uri), keep=3)
    for step in (5, 6):
        manager.save(staging(tmp_path, step), step, {"run_id": "run-a"})
    bad = tmp_path / "bad-shard.bin"
    bad.write_bytes(b"\x07" * 1000)  # same size as the real shard, other bytes: only the checksum tells
    manager.store.upload(bad, step_dir(6) + "model/shard-0.bin")
    with caplog.at_level(logging.WARNING, logger="kuberl.checkpoint"):
        restored = manager.restore_newest(tmp_path / "restore", "run-a")
    assert restored is not None and restored.step == 5
    assert (tmp_path / "restore" / "restore-5" / "trainer_state.json").read_text() == '{"step": 5}'
    assert f"{uri}{step_dir(6)}" in caplog.text and "falling back" in caplog.text


def test_a_run_refuses_another_runs_checkpoints(uri, tmp_path):
    manager = CheckpointManager(open_store(uri), keep=2)
    manager.save(staging(tmp_path, 3), 3, {"run_id": "uid-of-run-a"})
    with pytest.raises(ForeignCheckpoint, match=r"belongs to run uid-of-run-a, not to this run \(uid-of-run-b\)"):
        manager.restore_newest(tmp_path / "restore", "uid-of-run-b")
    assert manager.restore_newest(tmp_path / "restore", "uid-of-run-a").step == 3


def test_a_run_with_an_id_refuses_a_checkpoint_that_names_none(uri, tmp_path):
    """Write access to the bucket must not be enough to hand a run weights: a manifest without a run
    id is nobody's, so a run that has one does not resume from it."""
    manager = CheckpointManager(open_store(uri), keep=2)
    manager.save(staging(tmp_path, 3), 3)
    with pytest.raises(ForeignCheckpoint, match=r"names no run .*not to this run \(uid-of-run-b\)"):
        manager.restore_newest(tmp_path / "restore", "uid-of-run-b")
    assert manager.restore_newest(tmp_path / "restore", None).step == 3  # a run without identity (kuberl run)


def test_a_manifest_naming_files_outside_its_directory_is_refused(tmp_path, caplog):
    """A manifest rewritten to name ``../../x`` (sizes and hashes made to match): skipped when listed,
    refused by restore before anything is written, and nothing lands outside the restore directory."""
    import json

    root = tmp_path / "store"
    manager = CheckpointManager(open_store(f"file://{root}/"), keep=2)
    manager.save(staging(tmp_path, 4), 4)
    manifest_path = root / step_dir(4) / "MANIFEST.json"
    data = json.loads(manifest_path.read_text())
    entry = data["files"]["trainer_state.json"]
    (root / step_dir(4) / "../../x").parent.mkdir(parents=True, exist_ok=True)
    (root / step_dir(4) / "../../x").write_text('{"step": 4}')
    data["files"]["../../x"] = entry
    manifest_path.write_text(json.dumps(data))
    assert manager.complete() == [] and "outside its directory" in caplog.text
    from kuberl.checkpoint import Manifest

    with pytest.raises(CheckpointError, match="outside its directory"):
        manager.restore(Manifest(4, data["files"], {}), tmp_path / "restore" / "a" / "b")
    assert not (tmp_path / "restore" / "x").exists()  # where ../../x from restore/a/b would have landed


def test_two_runs_on_one_uri_never_prune_each_other(uri, tmp_path):
    """Two experiments pointed at one URI (an old run's pods still writing, or a copy-pasted spec):
    each keeps its own newest checkpoints and its own upload in progress, whatever the other prunes."""
    a = CheckpointManager(open_store(uri), keep=2, run_id="run-a")
    b = CheckpointManager(open_store(uri), keep=2, run_id="run-b")
    for step in (10, 15, 20, 25, 30):
        (a if step % 10 == 0 else b).save(staging(tmp_path, step), step)
    a.upload_files(staging(tmp_path, 40), 40)  # run a's next checkpoint, files landing, no manifest yet
    b.save(staging(tmp_path, 45), 45)
    b.save(staging(tmp_path, 55), 55)
    steps = {int(k.split("/")[0][5:]) for k in a.store.list()}
    assert steps == {20, 30, 40, 45, 55}  # a: its 2 newest + its partial; b: its 2 newest
    assert [m.meta["run_id"] for m in a.complete()] == ["run-b", "run-b", "run-a", "run-a"]
    a.commit(40, {"model/shard-0.bin": {"size": 1000, "sha256": ""}, "trainer_state.json": {"size": 12, "sha256": ""}})
    assert {int(k.split("/")[0][5:]) for k in a.store.list()} == {30, 40, 45, 55}


def test_pruning_aborts_the_multipart_uploads_a_killed_writer_left(tmp_path, aws_env):
    """A writer killed in the middle of a multipart upload leaves parts that no listing of objects
    shows (and that the bucket bills for): pruning its abandoned step aborts them too."""
    import boto3

    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket="multipart")
    manager = CheckpointManager(open_store("s3://multipart/exp/"), keep=1, run_id="run-a")
    manager.save(staging(tmp_path, 1), 1)
    manager.store.write_text(step_dir(2) + "RUN", "run-a")  # the killed writer's step: its marker, then
    client = manager.store.client
    upload = client.create_multipart_upload(Bucket="multipart", Key="exp/" + step_dir(2) + "model/shard-0.bin")
    client.upload_part(Bucket="multipart", Key=upload["Key"], UploadId=upload["UploadId"], PartNumber=1,
                       Body=b"x" * 1024)  # one part of a shard, never completed
    assert len(manager.store.multipart_uploads()) == 1
    manager.save(staging(tmp_path, 3), 3)
    assert manager.store.multipart_uploads() == []
    assert {k.split("/")[0] for k in manager.store.list()} == {step_dir(3).rstrip("/")}


def test_s3_unreachable_fails_clearly_and_keeps_local_state(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    nothing_listens = f"http://127.0.0.1:{free_port()}"
    manager = CheckpointManager(open_store("s3://bucket/p/", max_attempts=2, endpoint=nothing_listens))
    stage = staging(tmp_path, 7)
    with pytest.raises(CheckpointError, match=r"s3://bucket/p/") as err:
        manager.save(stage, 7)
    assert "very-secret-value" not in str(err.value)
    assert (stage / "model" / "shard-0.bin").stat().st_size == 1000  # nothing lost locally


def test_bad_uri_names_the_field():
    with pytest.raises(CheckpointError, match=r"spec\.checkpoint\.uri"):
        open_store("gs://bucket/x")


@pytest.mark.slow
def test_writer_killed_during_a_real_upload_leaves_nothing_usable(uri, tmp_path, caplog):
    """A separate process uploads a checkpoint of several 20 MiB shards and is SIGKILLed as soon as
    the first shard has landed: the store then holds a step without a manifest, and it is skipped."""
    manager = CheckpointManager(open_store(uri), keep=3)
    manager.save(staging(tmp_path, 1), 1)
    big = staging(tmp_path, 2, big=True)
    for i in (1, 2, 3):
        (big / "model" / f"shard-{i}.bin").write_bytes(bytes([i]) * (20 << 20))
    code = ("import sys; from pathlib import Path; from kuberl.checkpoint import CheckpointManager, open_store; "
            "CheckpointManager(open_store(sys.argv[1])).save(Path(sys.argv[2]), 2)")  # fmt: skip
    writer = subprocess.Popen([sys.executable, "-c", code, uri, str(big)], env=os.environ.copy())
    deadline = time.monotonic() + 60
    while not any(k.startswith(step_dir(2)) for k in manager.store.list()):
        assert writer.poll() is None, "the upload finished before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.kill()
    writer.wait()
    assert step_dir(2) + "MANIFEST.json" not in manager.store.list()
    with caplog.at_level(logging.WARNING, logger="kuberl.checkpoint"):
        assert manager.latest().step == 1
    assert "incomplete" in caplog.text


def test_with_a_key_only_manifests_it_signed_are_restored(tmp_path, caplog):
    """Write access to the bucket is not enough: a step's file replaced by a pickle that would create a
    marker (size and SHA-256 updated in the manifest) is refused before anything is downloaded; a
    forged newer step is skipped for the older signed one; unsigned-only checkpoints stop the run
    rather than letting it start over them. Without the key the same tampering would be restored."""
    import hashlib
    import json
    import pickle

    from kuberl.checkpoint.manager import UntrustedCheckpoint

    class Marker:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    root = tmp_path / "store"
    key = b"k" * 32
    manager = CheckpointManager(open_store(f"file://{root}/"), keep=3, run_id="run-a", signing_key=key)
    manager.save(staging(tmp_path, 4), 4)
    manager.save(staging(tmp_path, 5), 5)
    payload = pickle.dumps(Marker())
    manifest_path = root / step_dir(5) / "MANIFEST.json"
    (root / step_dir(5) / "model" / ".metadata").write_bytes(payload)
    data = json.loads(manifest_path.read_text())
    data["files"]["model/.metadata"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    manifest_path.write_text(json.dumps(data))

    restored = manager.restore_newest(tmp_path / "restore", "run-a")
    assert restored is not None and restored.step == 4 and "not signed with this experiment's key" in caplog.text
    assert not (tmp_path / "restore" / "restore-5").exists()
    with pytest.raises(UntrustedCheckpoint, match="not signed"):
        manager.restore(manager.complete()[0], tmp_path / "elsewhere")
    unsigned = CheckpointManager(open_store(f"file://{root}/"), keep=3, run_id="run-a")
    assert unsigned.restore_newest(tmp_path / "unchecked", "run-a").step == 5  # what the key prevents
    assert (tmp_path / "unchecked" / "restore-5" / "model" / ".metadata").read_bytes() == payload
    other_key = CheckpointManager(open_store(f"file://{root}/"), keep=3, run_id="run-a", signing_key=b"x" * 32)
    with pytest.raises(UntrustedCheckpoint, match=r"steps \[5, 4\] are not signed"):
        other_key.restore_newest(tmp_path / "restore-other", "run-a")
    assert not (tmp_path / "pwned").exists()
