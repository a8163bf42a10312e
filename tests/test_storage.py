"""Storage on a cluster: what `kuberl validate` and the operator refuse (a file:// URI no volume
holds, disk weight sync without a shared directory, two credential Secrets), and what every
workload pod gets (S3 credentials only as secretKeyRef, endpoint, region, claims, service
account). `kuberl run` keeps accepting file:// paths: its processes share this machine's disk."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from kuberl.api import validate_document
from kuberl_operator.builders.experiment import InvalidSpec

from .conftest import MINIMAL
from .test_builders import by_kind, container, render


def experiment(**spec: object) -> dict:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].update(spec)
    return doc


VOLUME = {"volumes": [{"claimName": "shared-data", "mountPath": "/data"}]}


@pytest.mark.parametrize(
    ("spec", "field", "fragment"),
    [
        ({"checkpoint": {"uri": "file:///tmp/ckpt/"}}, "spec.checkpoint.uri", "gone when the pod is replaced"),
        ({"dataset": {"path": "file:///srv/train.jsonl"}, "storage": VOLUME}, "spec.dataset.path",
         "mount a PersistentVolumeClaim"),
        ({"dataset": {"path": "/srv/train.jsonl"}}, "spec.dataset.path", "/srv/train.jsonl on a cluster"),  # plain
        ({"model": {"path": "/models/qwen"}}, "spec.model.path", "/models/qwen on a cluster"),
        ({"evaluation": {"dataset": {"path": "/srv/test.jsonl"}}}, "spec.evaluation.dataset.path",
         "gone when the pod is replaced"),
        ({"checkpoint": {"uri": "file:///data/ckpt/"},
          "storage": {"volumes": [{"claimName": "ro", "mountPath": "/data", "readOnly": True}]}},
         "spec.checkpoint.uri", "mounted readOnly"),
        ({"weightSync": {"mode": "disk"}}, "spec.weightSync.directory", "ReadWriteMany"),
        ({"storage": {"credentialsSecret": "a"}, "checkpoint": {"credentialsSecret": "b"}},
         "spec.checkpoint.credentialsSecret", "one Secret serves every s3:// URI"),
        ({"storage": {"volumes": [{"claimName": "x", "mountPath": "/tmp/x"}]}}, "spec.storage.volumes[0].mountPath",
         "overlaps a path the pods need"),
        ({"storage": {"endpoint": "not a url"}}, "spec.storage.endpoint", "pattern"),
        ({"storage": {"credentialsSecret": "Bad_Name"}}, "spec.storage.credentialsSecret", "pattern"),
        ({"storage": {"hubTokenSecret": {"name": "demo-api-token", "key": "token"}}},
         "spec.storage.hubTokenSecret.name", "the experiment's API token"),
        ({"logging": {"wandb": {"project": "p", "apiKeySecret": {"name": "demo-api-token", "key": "token"}}}},
         "spec.logging.wandb.apiKeySecret.name", "the experiment's API token"),
        ({"logging": {"mlflow": {"trackingUri": "https://mlflow:5000", "credentialsSecret": "demo-api-token"}}},
         "spec.logging.mlflow.credentialsSecret", "the experiment's API token"),
        ({"logging": {"mlflow": {"trackingUri": "mlflow:5000"}}}, "spec.logging.mlflow.trackingUri", "pattern"),
        ({"agent": {"command": ["python", "agent.py"], "env": [{"name": "STOLEN", "valueFrom": {"secretKeyRef": {
            "name": "other-api-token", "key": "token"}}}]}},
         "spec.agent.env[0].valueFrom.secretKeyRef.name", "a token KubeRL manages"),  # another experiment's
        ({"storage": {"credentialsSecret": "other-agent-token"}}, "spec.storage.credentialsSecret",
         "a token KubeRL manages"),
    ],
)
def test_what_cannot_work_on_a_cluster_is_refused_naming_the_field(spec, field, fragment):
    obj, issues = validate_document(experiment(**spec))
    assert obj is None
    assert [i.path for i in issues] == [field], issues
    assert fragment in issues[0].message
    if fragment != "pattern":  # the operator refuses it too, before creating anything
        with pytest.raises(InvalidSpec, match=r"spec\."):
            render(experiment(**spec))


def test_local_runs_keep_file_paths_and_volumes_make_them_valid_on_a_cluster():
    local_only = experiment(checkpoint={"uri": "file:///tmp/ckpt/"})
    assert validate_document(local_only, cluster=False)[0] is not None
    on_volume = experiment(checkpoint={"uri": "file:///data/ckpt/"}, weightSync={"mode": "disk",
                           "directory": "/data/weights"}, storage=VOLUME)  # fmt: skip
    assert validate_document(on_volume) == (validate_document(on_volume)[0], [])


def test_every_workload_pod_gets_storage_by_reference_only():
    doc = experiment(
        checkpoint={"uri": "s3://ckpt/run/", "credentialsSecret": "s3-credentials"},
        storage={"endpoint": "https://minio.example:9000", "region": "eu-west-1", "serviceAccountName": "rl-runner",
                 "volumes": [{"claimName": "datasets", "mountPath": "/data", "readOnly": True}],
                 "hubTokenSecret": {"name": "hf", "key": "token"}, "hubEndpoint": "https://hf-mirror.example"},
        dataset={"path": "file:///data/train.jsonl"},
    )
    manifests = render(doc)
    pods = by_kind(manifests, "Pod")
    assert {p["metadata"]["labels"]["kuberl.io/role"] for p in pods} == {"inference", "trainer"}
    for pod in pods:
        env = {e["name"]: e for e in container(pod)["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": key}}}
        assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert env["KUBERL_S3_ENDPOINT"]["value"] == "https://minio.example:9000"
        assert env["AWS_REGION"]["value"] == env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example"
        claim = next(v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v)
        assert claim["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
        mount = next(m for m in container(pod)["volumeMounts"] if m["name"] == claim["name"])
        assert mount == {"name": claim["name"], "mountPath": "/data", "readOnly": True}
        assert pod["spec"]["serviceAccountName"] == "rl-runner"
    rendered = yaml.safe_dump_all(manifests)
    assert "value: s3-credentials" not in rendered  # a name in secretKeyRef, never an env value


def test_the_trainer_gets_its_trackers_credentials_by_reference_only_and_the_pool_none():
    doc = experiment(logging={
        "wandb": {"project": "rl", "apiKeySecret": {"name": "wandb", "key": "api-key"},
                  "baseUrl": "https://wandb.example"},
        "mlflow": {"trackingUri": "https://mlflow.example", "credentialsSecret": "mlflow"}})
    pods = by_kind(render(doc), "Pod")
    for pod in pods:
        env = {e["name"]: e for e in container(pod)["env"]}
        if pod["metadata"]["labels"]["kuberl.io/role"] != "trainer":
            assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & set(env)  # replicas log nothing
            continue
        assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
        assert env["WANDB_BASE_URL"]["value"] == "https://wandb.example"
        for key in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "mlflow", "key": key, "optional": True}}


@pytest.mark.parametrize(("spec", "field"), [
    ({"storage": {"endpoint": "http://minio.storage:9000", "credentialsSecret": "s3"}}, "spec.storage.endpoint"),
    ({"storage": {"endpoint": "http://minio.storage:9000"},
      "checkpoint": {"uri": "s3://c/", "credentialsSecret": "s3"}},
     "spec.storage.endpoint"),
    ({"storage": {"hubEndpoint": "http://mirror:8080", "hubTokenSecret": {"name": "hf", "key": "t"}}},
     "spec.storage.hubEndpoint"),
    ({"logging": {"wandb": {"project": "p", "baseUrl": "http://wandb:8080",
                            "apiKeySecret": {"name": "w", "key": "k"}}}},
     "spec.logging.wandb.baseUrl"),
    ({"logging": {"mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "m"}}},
     "spec.logging.mlflow.trackingUri"),
])
def test_credentials_never_travel_to_a_plain_http_endpoint_unless_allowed(spec, field):
    """Issue 69, item 8: whoever sits on the path of an http:// endpoint reads the credentials sent there.
    Refused naming the endpoint's field; https://, no credential, or spec.storage.allowInsecureEndpoint
    (an in-cluster MinIO without TLS) pass. A standalone TrainerJob is held to the same rule."""
    doc = experiment(**spec)
    _, issues = validate_document(doc)
    assert [i.path for i in issues] == [field] and "allowInsecureEndpoint" in issues[0].message, issues
    allowed = experiment(**{**spec, "storage": {**spec.get("storage", {}), "allowInsecureEndpoint": True}})
    assert validate_document(allowed)[1] == []
    secure = json.loads(json.dumps(doc).replace("http://", "https://"))
    assert validate_document(secure)[1] == []
    job = {"apiVersion": "kuberl.io/v1alpha1", "kind": "TrainerJob", "metadata": {"name": "j"},
           "spec": {k: v for k, v in spec.items() if k in ("storage", "logging")}}
    if "checkpoint" not in spec:
        assert [i.path for i in validate_document(job)[1]] == [field]
