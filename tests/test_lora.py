"""LoRA RL (spec.trainer.lora): only the adapter trains, is checkpointed and travels; the engine that
receives it serves the trainer's policy; the export loads with transformers (merged) and with peft
(the adapter on its base) and answers as the trainer's policy does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import peft
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from kuberl.api.lora import LoraSpec
from kuberl.api.spec import ExportSpec, ModelSource
from kuberl.checkpoint import CheckpointError
from kuberl.fsdp.actor import FSDPActor
from kuberl.inference.contract import SamplingParams
from kuberl.inference.engine import TorchEngine
from kuberl.models import lora
from kuberl.models.loading import load_skeleton
from kuberl.models.pretrained import tiny_qwen2_arithmetic
from kuberl.models.tiny import char_tokenizer, chat_tokenizer, tiny_qwen2
from kuberl.policy.actor import token_logprobs
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import collate
from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer
from kuberl.trainer.export import export_policy
from kuberl.weights.sync import update_bytes

from .test_actor import trajectories

CONFIG = AlgorithmConfig(name="grpo", group_size=4, behavior_imp_cap=None)
ADAPTER = LoraSpec(rank=4, target_modules=["all-linear"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) model, whole, under its own names (base_layer and adapter apart)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def lora_actor(seed: int = 3, adapter: LoraSpec = ADAPTER, vocab: int = 40) -> FSDPActor:
    return FSDPActor.create(tiny_qwen2(vocab, seed=seed), CONFIG, lr=1e-2, temperature=1.0, adapter=adapter)


def trained(actor: FSDPActor, steps: int = 2) -> FSDPActor:
    for s in range(steps):
        actor.train_step(collate(*trajectories(8, seed=s), 0), 8)
    return actor


def test_merging_folds_the_update_in_as_peft_does_and_answers_as_the_adapted_model():
    model = lora.add_adapter(tiny_qwen2(40, seed=1), LoraSpec(rank=4, alpha=12, target_modules=["all-linear"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter_weight(name):
                p.normal_(0, 0.1)  # B ≠ 0: an update to fold in
    ids = torch.tensor([[2, 5, 9, 7, 11, 6]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    folded = lora.merged(model.state_dict(), scaling=12 / 4)
    plain = tiny_qwen2(40, seed=1)
    assert set(folded) == set(plain.state_dict())  # the base model's names, nothing else
    plain.load_state_dict(folded)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, adapted, atol=1e-5)
        assert not torch.allclose(adapted, tiny_qwen2(40, seed=1)(input_ids=ids).logits, atol=1e-3)
    for module in model.modules():  # peft's own merge, into the base layers
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    by_peft = {lora.file_name(n): t for n, t in model.state_dict().items() if not lora.is_adapter_weight(n)}
    for name, tensor in folded.items():
        assert torch.allclose(tensor, by_peft[name], atol=1e-6), name


def test_only_the_adapter_trains_and_the_base_stays_as_loaded(world_of_one):
    actor = lora_actor()
    before = full_weights(actor.model)
    trained(actor)
    after = full_weights(actor.model)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(lora.is_adapter_weight(n) for n in moved)
    assert {n for n in before if n.endswith(lora.LORA_B)} <= moved  # B left zero, where every update starts
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in actor.model.named_parameters() if lora.is_adapter_weight(n)}
    assert not torch.equal(actor.full_state_dict()["model.layers.0.mlp.up_proj.weight"],
                           tiny_qwen2(40, seed=3).state_dict()["model.layers.0.mlp.up_proj.weight"])


def test_an_update_carries_the_adapter_alone_and_the_engine_then_serves_the_trainers_policy(world_of_one):
    """The engine holds the base and an untrained adapter; after the update its sampling log-probs
    are the trainer's (compare outputs, not names); before it, they were not."""
    tok = char_tokenizer()
    actor = trained(lora_actor(vocab=len(tok)), steps=3)
    source = actor.weight_source()
    update = source.full_state_dict()
    assert update and all(lora.is_adapter_weight(n) for n in update)
    assert set(update) == set(source.named_parameters()) == set(source.local_parameters())
    fraction = update_bytes(source) / update_bytes(actor)
    assert 0 < fraction < 0.2

    engine = TorchEngine(lora.add_adapter(tiny_qwen2(len(tok), seed=3), ADAPTER), tok.eos_token_id, tok.pad_token_id)
    assert set(engine.parameter_layout()) == set(update)
    prompt = [tok.bos_token_id, *tok("3+4=", add_special_tokens=False).input_ids]

    def trainer_logprobs(ids: list[int]) -> torch.Tensor:
        batch = collate([trajectory(prompt, ids)], [0.0], tok.pad_token_id)
        with torch.no_grad():
            return token_logprobs(actor.model, batch, 1.0)[0, -len(ids):]

    async def serve() -> list[tuple[list[int], list[float]]]:
        engine.start()
        try:
            params = SamplingParams(max_new_tokens=6, temperature=1.0)
            before = await engine.generate(prompt, params)
            await engine.load_weights(update, version=1)
            after = await engine.generate(prompt, params)
            with pytest.raises(ValueError, match="missing"):  # a partial adapter is refused whole
                await engine.load_weights(dict(list(update.items())[1:]), version=2)
            return [(before.output_ids, before.logprobs), (after.output_ids, after.logprobs)]
        finally:
            await engine.stop()

    (before_ids, before_logp), (after_ids, after_logp) = asyncio.run(serve())
    assert not torch.allclose(trainer_logprobs(before_ids), torch.tensor(before_logp), atol=1e-3)
    assert engine.version == 1
    assert torch.allclose(trainer_logprobs(after_ids), torch.tensor(after_logp), atol=1e-4)


def trajectory(prompt: list[int], output: list[int]):
    from kuberl.rollout.types import Trajectory

    return Trajectory(prompt, output, [0.0] * len(output), [0] * len(output))


def test_a_checkpoint_holds_the_adapter_and_resumes_it_exactly(world_of_one, tmp_path: Path):
    actor = trained(lora_actor())
    save_trainer(actor, TrainerState.capture(2, 2, 16), tmp_path / "ckpt")
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and [k for k in model_keys if not lora.is_adapter_weight(k.removeprefix("model."))] == []

    resumed = lora_actor()  # the same base, another adapter draw is overwritten by the checkpoint
    with torch.no_grad():
        for name, p in resumed.model.named_parameters():
            if lora.is_adapter_weight(name):
                p.to_local().add_(1.0)
    load_trainer(resumed, tmp_path / "ckpt")
    batch = collate(*trajectories(8, seed=9), 0)
    assert resumed.train_step(batch, 8)["ppo_actor/loss"] == actor.train_step(batch, 8)["ppo_actor/loss"]
    for name, tensor in full_weights(actor.model).items():
        assert torch.equal(full_weights(resumed.model)[name], tensor), name

    with pytest.raises(CheckpointError, match=r"spec\.trainer"):  # a whole-model run cannot take it
        load_trainer(FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lora rank 4"):
        load_trainer(lora_actor(adapter=LoraSpec(rank=8)), tmp_path / "ckpt")


def test_the_export_is_the_merged_policy_and_the_adapter_in_peft_format(world_of_one, tmp_path: Path):
    tok = chat_tokenizer()
    actor = trained(lora_actor(vocab=len(tok)))
    export_policy(actor, tok, 2, f"file://{tmp_path}/ckpt/", ExportSpec(dtype="float32"), tmp_path / "s", None, 0,
                  base_model="builtin:tiny-qwen2")
    where = tmp_path / "ckpt" / "hf" / "step-00000002"
    ids = torch.tensor([[2, 5, 9, 7, 11, 6]])
    with torch.no_grad():
        expected = actor.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)
        adapted = peft.PeftModel.from_pretrained(tiny_qwen2(len(tok), seed=3), where / "adapter")
        assert torch.allclose(adapted(input_ids=ids).logits, expected, atol=1e-5)
    config = json.loads((where / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "builtin:tiny-qwen2"

    only = lora_actor(vocab=len(tok), adapter=LoraSpec(rank=4, target_modules=["all-linear"], export_merged=False))
    export_policy(only, tok, 1, f"file://{tmp_path}/only/", ExportSpec(), tmp_path / "s", None, 0)
    files = json.loads((tmp_path / "only" / "hf" / "step-00000001" / "MANIFEST.json").read_text())
    assert files["meta"]["kind"] == "peft-adapter" and not any(f.startswith("model") for f in files["files"])


def test_a_model_loaded_on_meta_gets_the_files_base_and_the_same_adapter_draw_every_time(world_of_one, tmp_path):
    tiny_qwen2(40, seed=5).save_pretrained(tmp_path / "model")
    actors = []
    for _ in range(2):
        model, _, weights = load_skeleton(ModelSource(path=f"file://{tmp_path / 'model'}"), 0)
        actors.append(FSDPActor.create(model, CONFIG, lr=1e-2, temperature=1.0, weights=weights, adapter=ADAPTER,
                                       seed=7))
    files = tiny_qwen2(40, seed=5).state_dict()
    merged = actors[0].full_state_dict()  # B = 0: the base as it is in the files
    for name, tensor in files.items():
        assert torch.equal(merged[name], tensor), name
    first, second = (full_weights(a.model) for a in actors)
    a_weights = [n for n in first if n.endswith(lora.LORA_A)]
    assert a_weights and all(torch.equal(first[n], second[n]) and first[n].abs().sum() > 0 for n in a_weights)


def by_hand_in_mixed_precision(model: torch.nn.Module) -> FSDPActor:
    """``model`` (adapter on) sharded as FSDP2 mixed precision does it by itself, every weight kept in
    float32 — what a bfloat16 run held before its frozen base was stored in bfloat16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    trained = [p for p in model.parameters() if p.requires_grad]
    return FSDPActor(model.train(), torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0, foreach=True), CONFIG, 1.0,
                     adapter=ADAPTER)


def stored_bytes(model: torch.nn.Module, adapter: bool) -> dict[torch.dtype, int]:
    """Bytes of this rank's shards of the adapter's (or the other) parameters, by dtype."""
    out: dict[torch.dtype, int] = {}
    for name, param in model.named_parameters():
        if lora.is_adapter_weight(name) == adapter:
            local = param.to_local() if hasattr(param, "to_local") else param
            out[local.dtype] = out.get(local.dtype, 0) + local.numel() * local.element_size()
    return out


def same_numbers(stats: dict[str, float]) -> dict[str, float]:
    """A step's stats but its timings and NaNs (a NaN equals nothing)."""
    return {k: v for k, v in stats.items() if not k.startswith("timeperf/") and v == v}


def test_in_bfloat16_the_frozen_base_is_held_in_bfloat16_and_the_adapter_trains_bit_for_bit_as_before(world_of_one):
    """Mixed precision computes with the base in bfloat16 whatever it is stored in, so storing it in
    bfloat16 halves its memory and changes nothing: the same losses, gradient norms and adapter after
    two steps as with the base held in float32; the adapter and its optimizer stay float32."""
    torch.manual_seed(0)  # the adapter's A, as peft draws it
    actor = FSDPActor.create(tiny_qwen2(40, seed=3), CONFIG, lr=1e-2, temperature=1.0, adapter=ADAPTER,
                             compute_dtype=torch.bfloat16)
    torch.manual_seed(0)
    before = by_hand_in_mixed_precision(lora.add_adapter(tiny_qwen2(40, seed=3), ADAPTER))
    base_now, base_before = stored_bytes(actor.model, adapter=False), stored_bytes(before.model, adapter=False)
    assert set(base_now) == {torch.bfloat16} and set(base_before) == {torch.float32}
    assert 2 * base_now[torch.bfloat16] == base_before[torch.float32]
    assert stored_bytes(actor.model, adapter=True).keys() == {torch.float32}
    for step in range(2):
        batch = collate(*trajectories(8, seed=step), 0)
        now_stats, then_stats = actor.train_step(batch, 8), before.train_step(batch, 8)
        assert same_numbers(now_stats) == same_numbers(then_stats) and now_stats["ppo_actor/grad_norm"] > 0
    now, then = full_weights(actor.model), full_weights(before.model)
    adapter = [n for n in now if lora.is_adapter_weight(n)]
    assert adapter and all(torch.equal(now[n], then[n]) for n in adapter)
    assert not torch.equal(now[adapter[-1]], lora.add_adapter(tiny_qwen2(40, seed=3), ADAPTER).state_dict()[
        adapter[-1]])  # it trained


def test_a_bfloat16_model_loaded_on_meta_holds_the_files_base_rounded_once(world_of_one, tmp_path):
    tiny_qwen2(40, seed=5).save_pretrained(tmp_path / "model")
    model, _, weights = load_skeleton(ModelSource(path=f"file://{tmp_path / 'model'}"), 0)
    actor = FSDPActor.create(model, CONFIG, lr=1e-2, temperature=1.0, weights=weights, adapter=ADAPTER, seed=7,
                             compute_dtype=torch.bfloat16)
    files = tiny_qwen2(40, seed=5).state_dict()
    held = {lora.file_name(name): tensor for name, tensor in full_weights(actor.model).items() if lora.file_name(name)}
    assert held.keys() == files.keys()
    for name, tensor in files.items():
        assert held[name].dtype == torch.bfloat16 and torch.equal(held[name], tensor.to(torch.bfloat16)), name


def test_targets_that_match_no_layer_are_refused_naming_the_field():
    with pytest.raises(lora.AdapterError, match=r"spec\.trainer\.lora\.targetModules"):
        lora.add_adapter(tiny_qwen2(40, seed=1), LoraSpec(rank=4, target_modules=["no_such_proj"]))


@pytest.mark.slow
def test_the_pretrained_builtin_is_the_same_every_build_and_already_knows_its_task():
    tok = char_tokenizer()
    first, second = tiny_qwen2_arithmetic(len(tok), 0), tiny_qwen2_arithmetic(len(tok), 0)
    for name, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[name], tensor), name
    from kuberl.models.pretrained import addition_rows

    ids, labels, mask = addition_rows()

    def answer_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)))

    assert answer_loss(first) < 0.6 * answer_loss(tiny_qwen2(len(tok), 0))
