"""The policy as a Hugging Face directory (spec.export): transformers loads it, its weights are the
trainer's, it answers as the trainer's policy does, and it is complete only once its manifest is."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kuberl.api.spec import ExportSpec
from kuberl.fsdp.actor import FSDPActor
from kuberl.models.tiny import chat_tokenizer, tiny_qwen2
from kuberl.policy.actor import Actor
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.trainer.export import export_due, export_policy

CONFIG = AlgorithmConfig(name="grpo", group_size=4)


def trained_actor() -> tuple[Actor, object]:
    tok = chat_tokenizer()
    actor = FSDPActor.create(tiny_qwen2(len(tok), seed=4), CONFIG, lr=1e-2, temperature=1.0)
    with torch.no_grad():  # weights no fresh model has: the export must carry these
        for param in actor.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.add_(0.01 * torch.randn_like(local))
    return actor, tok


def test_an_export_loads_with_transformers_and_answers_as_the_trainers_policy(world_of_one, tmp_path: Path):
    actor, tok = trained_actor()
    result = export_policy(actor, tok, 7, f"file://{tmp_path}/ckpt/", ExportSpec(dtype="float32"),
                           tmp_path / "staging", "run-1", rank=0)
    assert result is not None and result["uri"] == f"file://{tmp_path}/ckpt/hf/step-00000007/"
    where = tmp_path / "ckpt" / "hf" / "step-00000007"
    manifest = json.loads((where / "MANIFEST.json").read_text())
    assert manifest["meta"] == {"kind": "huggingface", "dtype": "float32", "run_id": "run-1"}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    loaded = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
    want = actor.full_state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    loaded_tok = AutoTokenizer.from_pretrained(where)
    assert loaded_tok.chat_template == tok.chat_template  # the template travels with the model
    policy = tiny_qwen2(len(tok), seed=4)
    policy.load_state_dict(want)
    prompts = [loaded_tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
               for a in range(4) for b in range(4)]
    for ids in prompts:  # 16 prompts, greedy: the export answers exactly as the trainer's policy
        x = torch.tensor([ids])
        ours = policy.eval().generate(x, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        theirs = loaded.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert torch.equal(ours, theirs)


def test_a_bfloat16_export_is_half_the_size_and_says_so(world_of_one, tmp_path: Path):
    actor, tok = trained_actor()
    full = export_policy(actor, tok, 1, f"file://{tmp_path}/a/", ExportSpec(dtype="float32"), tmp_path / "s", None, 0)
    half = export_policy(actor, tok, 1, f"file://{tmp_path}/b/", ExportSpec(), tmp_path / "s", None, 0)
    assert full is not None and half is not None
    weights = [sum(p.stat().st_size for p in (tmp_path / d / "hf").rglob("*.safetensors")) for d in "ab"]
    assert weights[1] < 0.55 * weights[0]
    config = json.loads((tmp_path / "b" / "hf" / "step-00000001" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_exports_are_due_at_the_end_and_every_nth_checkpoint():
    every_other = ExportSpec(everyCheckpoints=2)
    assert [s for s in range(1, 101) if export_due(every_other, s, 10, last=s == 100)] == [20, 40, 60, 80, 100]
    assert [s for s in range(1, 101) if export_due(ExportSpec(), s, 10, last=s == 100)] == [100]
    assert not any(export_due(ExportSpec(final=False), s, 10, last=s == 100) for s in range(1, 101))


def test_kuberl_export_turns_a_finished_checkpoint_into_the_same_directory(world_of_one, tmp_path: Path, capsys):
    """A checkpoint as the trainer writes it (shards, state, model/), then `kuberl export` offline: the
    directory loads and holds the checkpoint's weights; a checkpoint without model/ needs --model."""
    from kuberl.checkpoint import CheckpointManager, open_store
    from kuberl.trainer.checkpointing import TrainerState, save_trainer
    from kuberl.trainer.export import describe_model
    from kuberl_cli.main import main

    actor, tok = trained_actor()
    want = actor.full_state_dict()
    manager = CheckpointManager(open_store(f"file://{tmp_path}/ckpt/"), keep=2, run_id="run-1")
    save_trainer(actor, TrainerState.capture(20, 20, 320), tmp_path / "s20",
                 lambda where: describe_model(actor.model.config, tok, where))
    save_trainer(actor, TrainerState.capture(30, 30, 480), tmp_path / "s30")  # an older trainer's: no model/
    manager.save(tmp_path / "s20", 20)
    manager.save(tmp_path / "s30", 30)

    assert main(["export", f"file://{tmp_path}/ckpt/step-00000020/", f"file://{tmp_path}/out/", "--dtype",
                 "float32"]) == 0
    assert capsys.readouterr().out.strip() == f"file://{tmp_path}/out/"
    manifest = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
    assert manifest["step"] == 20 and manifest["meta"]["source"] == f"file://{tmp_path}/ckpt/step-00000020/"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in want.items())

    assert main(["export", f"file://{tmp_path}/ckpt/step-00000030/", f"file://{tmp_path}/out30/"]) == 1
    assert "--model" in capsys.readouterr().err
    assert main(["export", f"file://{tmp_path}/ckpt/step-00000030/", f"file://{tmp_path}/out30/", "--model",
                 "builtin:tiny-qwen2-chat"]) == 0
    assert (tmp_path / "out30" / "tokenizer.json").is_file() and (tmp_path / "out30" / "MANIFEST.json").is_file()
    assert main(["export", f"file://{tmp_path}/ckpt/step-00000040/", f"file://{tmp_path}/x/"]) == 1
    assert "no complete checkpoint there" in capsys.readouterr().err


def test_a_new_run_starts_from_anothers_export(world_of_one, tmp_path: Path):
    """spec.model.initFrom: the weights of an export, whole (load_model: inference, Megatron) or
    shard by shard (load_skeleton: FSDP2); the tokenizer still comes from model.path."""
    from kuberl.api.spec import ModelSource
    from kuberl.models.loading import load_model, load_skeleton, model_origin

    actor, tok = trained_actor()
    want = actor.full_state_dict()
    done = export_policy(actor, tok, 9, f"file://{tmp_path}/first/", ExportSpec(dtype="float32"), tmp_path / "s",
                         None, 0)
    assert done is not None
    source = ModelSource(path="builtin:tiny-qwen2-chat", initFrom=done["uri"])
    whole, tokenizer = load_model(source, seed=0)
    assert all(torch.equal(whole.state_dict()[name], tensor) for name, tensor in want.items())
    skeleton, _, weights = load_skeleton(source, seed=0)
    second = FSDPActor.create(skeleton, CONFIG, lr=1e-2, temperature=1.0, weights=weights)
    assert all(torch.equal(second.full_state_dict()[name], tensor) for name, tensor in want.items())
    assert model_origin(source, tokenizer)["init_from"] == done["uri"]
    fresh, _ = load_model(ModelSource(path="builtin:tiny-qwen2-chat"), seed=4)
    assert not torch.equal(fresh.state_dict()["model.norm.weight"], want["model.norm.weight"])


def test_a_new_run_starts_from_anothers_checkpoint(world_of_one, tmp_path: Path):
    """spec.model.initFrom naming another run's FSDP2 checkpoint (…/step-N/): its weights, read once into
    an HF directory in the node's cache, reach the whole model and the sharded actor; a checkpoint without
    its model description, or one Megatron wrote, is refused naming the field."""
    import shutil

    import pytest

    from kuberl.api.spec import ModelSource
    from kuberl.checkpoint import CheckpointManager, open_store
    from kuberl.models.loading import ModelLoadError, load_model, load_skeleton
    from kuberl.settings import Settings
    from kuberl.trainer.checkpointing import TrainerState, save_trainer
    from kuberl.trainer.export import describe_model

    actor, tok = trained_actor()
    want = actor.full_state_dict()
    manager = CheckpointManager(open_store(f"file://{tmp_path}/first/"), keep=2, run_id="first-run")
    save_trainer(actor, TrainerState.capture(20, 20, 320), tmp_path / "s20",
                 lambda where: describe_model(actor.model.config, tok, where))
    uri = manager.save(tmp_path / "s20", 20)
    settings = Settings(cache_dir=tmp_path / "cache")
    source = ModelSource(path="builtin:tiny-qwen2-chat", initFrom=uri)
    whole, _ = load_model(source, seed=0, settings=settings)
    assert all(torch.equal(whole.state_dict()[name], tensor) for name, tensor in want.items())
    skeleton, _, weights = load_skeleton(source, seed=0, settings=settings)
    second = FSDPActor.create(skeleton, CONFIG, lr=1e-2, temperature=1.0, weights=weights)
    assert all(torch.equal(second.full_state_dict()[name], tensor) for name, tensor in want.items())
    assert len(list((tmp_path / "cache" / "init-from").glob("*/model.safetensors"))) == 1  # read once

    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "first" / "step-00000020", bare, ignore=shutil.ignore_patterns("model"))
    with pytest.raises(ModelLoadError, match=r"spec\.model\.initFrom: .*kuberl export"):
        load_model(ModelSource(path="builtin:tiny-qwen2-chat", initFrom=f"file://{bare}"), 0, settings)
    state = json.loads((tmp_path / "first" / "step-00000020" / "trainer_state.json").read_text())
    megatron = tmp_path / "megatron"
    shutil.copytree(tmp_path / "first" / "step-00000020", megatron)
    (megatron / "trainer_state.json").write_text(json.dumps(state | {"layout": {"backend": "megatron"}}))
    with pytest.raises(ModelLoadError, match=r"spec\.model\.initFrom: .*backend megatron"):
        load_model(ModelSource(path="builtin:tiny-qwen2-chat", initFrom=f"file://{megatron}"), 0, settings)


class RunsCode:
    """Unpickled, it creates ``marker``: what a crafted checkpoint would do in the trainer."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_init_from_unpickles_nothing_another_run_wrote(world_of_one, tmp_path: Path):
    """Issue 69, item 5: another run's checkpoint is not signed for this one, so neither of DCP's
    pickles may run code: a ``.metadata`` asking for anything but DCP's metadata classes is refused
    (naming what it asked for and pointing at the export), and a byte entry (the optimizer's) is never
    read — the weights still load."""
    import pytest
    import torch.distributed.checkpoint as dcp

    from kuberl.api.spec import ModelSource
    from kuberl.checkpoint import CheckpointManager, open_store
    from kuberl.models.loading import ModelLoadError, load_model
    from kuberl.settings import Settings
    from kuberl.trainer.checkpointing import TrainerState, save_trainer
    from kuberl.trainer.export import describe_model

    actor, tok = trained_actor()
    want = actor.full_state_dict()
    manager = CheckpointManager(open_store(f"file://{tmp_path}/other/"), keep=2, run_id="other-run")
    save_trainer(actor, TrainerState.capture(5, 5, 80), tmp_path / "s5",
                 lambda where: describe_model(actor.model.config, tok, where))
    step = Path(manager.save(tmp_path / "s5", 5).removeprefix("file://"))
    marker = tmp_path / "code-ran"

    byte_entry = tmp_path / "byte-entry"
    byte_entry.mkdir()
    for item in step.iterdir():
        if item.name != "dcp":
            (byte_entry / item.name).symlink_to(item)
    dcp.save({"model": want, "optim": {"state": RunsCode(marker)}}, checkpoint_id=str(byte_entry / "dcp"),
             no_dist=True)
    whole, _ = load_model(ModelSource(path="builtin:tiny-qwen2-chat", initFrom=f"file://{byte_entry}"), 0,
                          Settings(cache_dir=tmp_path / "cache"))
    assert all(torch.equal(whole.state_dict()[name], tensor) for name, tensor in want.items())
    assert not marker.exists(), "a byte entry of another run's checkpoint was unpickled"

    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ModelLoadError, match=r"spec\.model\.initFrom: .*posix\.system.*spec\.export"):
        load_model(ModelSource(path="builtin:tiny-qwen2-chat", initFrom=f"file://{step}"), 0,
                   Settings(cache_dir=tmp_path / "cache"))
    assert not marker.exists(), "another run's DCP metadata was unpickled"


def test_a_mixture_of_experts_exports_one_tensor_per_expert_as_the_hub_does(tmp_path: Path):
    """transformers stacks a Qwen3-MoE's experts in memory (``experts.gate_up_proj`` [E, 2I, H]) and
    writes them back one per expert (``experts.j.gate_proj.weight`` …), the layout of the hub's
    checkpoints that other readers (older transformers, other engines) expect: the export writes the
    names ``save_pretrained`` writes, and the same tensors under them."""
    from safetensors import safe_open

    from kuberl.models.hf_dir import write_hf_dir
    from kuberl.models.tiny import char_tokenizer, tiny_qwen3_moe

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        out = {}
        for path in directory.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                out |= {name: f.get_tensor(name) for name in f.keys()}
        return out

    tokenizer = char_tokenizer()
    model = tiny_qwen3_moe(len(tokenizer), 3, experts=3)
    write_hf_dir(model.state_dict(), model.config, tokenizer, tmp_path / "export", torch.float32)
    model.save_pretrained(tmp_path / "saved")
    exported, saved = tensors(tmp_path / "export"), tensors(tmp_path / "saved")
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in exported
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
