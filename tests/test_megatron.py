"""The Megatron-core backend on CPU: HF ↔ Megatron conversion (pure), the tensor-parallel split, and
a real megatron-core GPTModel (through ``kuberl.megatron.cpu.cpu_shim``) loaded from HF weights,
exported back bit for bit, giving the HF model's logits; layouts the trainer refuses. (The Megatron
actor against the FSDP actor in several processes: tests/test_megatron_actor.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kuberl.fsdp.actor import FSDPActor
from kuberl.megatron.actor import MegatronActor
from kuberl.megatron.convert import AttentionShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from kuberl.megatron.tensor_parallel import Split, shard, unshard
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.policy.actor import Actor
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, collate
from kuberl.rollout.types import Trajectory


def qwen2(tied: bool = True) -> torch.nn.Module:
    return tiny_qwen2(len(char_tokenizer()), seed=3, tied=tied)


def random_batch(vocab: int, seed: int, rows: int = 4) -> Batch:
    """Trajectories of random tokens and lengths (so the batch is right-padded), random behaviour
    log-probs and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for _ in range(rows):
        prompt, output = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
        ids = torch.randint(3, vocab, (prompt + output,), generator=g).tolist()
        behav = (-torch.rand(output, generator=g) * 4).tolist()
        trajs.append(Trajectory(ids[:prompt], ids[prompt:], behav, [0] * output))
    advantages = (torch.randn(rows, generator=g)).tolist()
    return collate(trajs, advantages, pad_id=0, version=0)


def llama_untied_gqa() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=40, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False,
                         max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(5)
    return LlamaForCausalLM(config)


def qwen3_qk_norm(tied: bool = True) -> torch.nn.Module:
    """Qwen3: per-head q/k RMSNorm (weights made random: at their initial ones a swapped or dropped
    norm would go unseen), no q/k/v bias, head_dim ≠ hidden / heads, grouped query attention."""
    config = Qwen3Config(vocab_size=len(char_tokenizer()), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=tied,
                         max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(7)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


def qwen3_moe(norm_topk_prob: bool = True, top_k: int = 2) -> torch.nn.Module:
    """Qwen3-MoE: 4 routed experts, top-2, in every layer; its stacked expert weights and q/k norms
    random (at init the experts are zeros here, and a mixed-up expert order would go unseen)."""
    config = Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                            tie_word_embeddings=False, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(11)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name or name.endswith(("q_norm.weight", "k_norm.weight", "mlp.gate.weight")):
                param.normal_(0.0, 0.3) if "norm" not in name else param.uniform_(0.5, 1.5)
    return model


MODELS = [qwen2, llama_untied_gqa, qwen3_qk_norm, qwen3_moe]
MODEL_IDS = ["qwen2-tied-bias", "llama-untied-gqa", "qwen3-qk-norm", "qwen3-moe"]


@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
def test_round_trip_is_exact(make):
    model = make()
    state = model.state_dict()
    megatron = hf_to_megatron(state, model.config)
    assert all(name.startswith(("embedding.", "decoder.", "output_layer.")) for name in megatron)
    assert ("output_layer.weight" in megatron) == (not model.config.tie_word_embeddings)
    back = megatron_to_hf(megatron, model.config)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # same number of values, nothing duplicated or lost (tied embedding counted once)
    unique = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in megatron.values()) == unique


def test_qkv_is_interleaved_by_query_group():
    shape = AttentionShape(heads=6, groups=2, head_dim=4)
    hidden = 5
    # row r of q belongs to head r // head_dim; label every row with (tensor, head)
    q = torch.arange(6).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 100
    k = torch.arange(2).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 200
    v = torch.arange(2).repeat_interleave(4).unsqueeze(1).float().expand(-1, hidden) + 300
    fused = fuse_qkv(q, k, v, shape)
    heads_in_order = fused[::4, 0].tolist()  # one row per head
    assert heads_in_order == [100, 101, 102, 200, 300, 103, 104, 105, 201, 301]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v), strict=True))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 5), size=st.sampled_from([1, 2, 4]), dim=st.sampled_from([0, 1]),
       gated=st.booleans())
def test_unshard_inverts_shard(rows, cols, size, dim, gated):
    shape = [rows * size * (2 if gated and dim == 0 else 1), cols * size * (2 if gated and dim == 1 else 1)]
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    split = Split(dim, gated)
    pieces = [shard(full, split, r, size) for r in range(size)]
    assert all(p.shape[dim] == full.shape[dim] // size for p in pieces)
    assert torch.equal(unshard(pieces, split), full)
    if gated and size > 1:  # each rank holds a slice of the gate half and of the up half
        gate, up = full.chunk(2, dim=dim)
        assert torch.equal(pieces[0], torch.cat([gate.chunk(size, dim)[0], up.chunk(size, dim)[0]], dim))


@settings(max_examples=40, deadline=None)
@given(stages=st.sampled_from([1, 2, 4]), per_stage=st.integers(1, 3), tied=st.booleans())
def test_pipeline_stages_hold_every_layer_once_and_give_it_back_under_its_own_number(stages, per_stage, tied):
    """Each stage's layers, renumbered from 0, are the model's consecutive layers; put back under
    their global numbers the stages make up the whole model again, each parameter once (a tied
    last stage's copy of the embedding, which it holds as its output layer, dropped); and every HF
    parameter's stage is the one that holds it."""
    from kuberl.megatron.convert import global_tensors
    from kuberl.megatron.pipeline import EMBEDDING, OUTPUT_LAYER, global_state, stage_globals, stage_state
    from kuberl.weights.layouts import hf_stage  # the planner's rule: the stages above hold what it says

    layers = stages * per_stage
    hf = {"model.embed_tokens.weight": torch.randn(3), "model.norm.weight": torch.randn(3),
          **{f"model.layers.{i}.mlp.down_proj.weight": torch.randn(2) for i in range(layers)},
          **({} if tied else {"lm_head.weight": torch.randn(3)})}
    whole = {f"decoder.layers.{i}.mlp.linear_fc2.weight": hf[f"model.layers.{i}.mlp.down_proj.weight"]
             for i in range(layers)} | {EMBEDDING: hf["model.embed_tokens.weight"],
                                        "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not tied:
        whole[OUTPUT_LAYER] = hf["lm_head.weight"]
    pieces = [stage_state(whole, layers, s, stages, tied) for s in range(stages)]
    for s, piece in enumerate(pieces):
        local_layers = {n.split(".")[2] for n in piece if n.startswith("decoder.layers.")}
        assert local_layers == {str(i) for i in range(per_stage)}
        assert torch.equal(piece["decoder.layers.0.mlp.linear_fc2.weight"],
                           hf[f"model.layers.{s * per_stage}.mlp.down_proj.weight"])
        assert (EMBEDDING in piece) == (s == 0)
        assert (OUTPUT_LAYER in piece) == (s == stages - 1 and (not tied or stages > 1))
    if tied and stages > 1:
        assert torch.equal(pieces[-1][OUTPUT_LAYER], hf["model.embed_tokens.weight"])
    config = SimpleNamespace(tie_word_embeddings=tied)
    for s, piece in enumerate(pieces):  # what a stage reads outside the layers: what it holds, nothing more
        read = global_tensors(hf, config, stage_globals(s, stages, tied))
        held = stage_state(read, layers, s, stages, tied)
        assert held.keys() == {n for n in piece if not n.startswith("decoder.layers.")}
        assert all(torch.equal(piece[n], t) for n, t in held.items())
        assert all(stage_state({k: t for k, t in read.items() if k != n}, layers, s, stages, tied) != held
                   for n in read)
    back = [global_state(piece, layers, s, stages, tied) for s, piece in enumerate(pieces)]
    assert sum(len(b) for b in back) == len(whole)
    assert all(torch.equal(whole[n], t) for b in back for n, t in b.items())
    hf_name = {EMBEDDING: "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
               OUTPUT_LAYER: "lm_head.weight"} | {f"decoder.layers.{i}.mlp.linear_fc2.weight":
                                                   f"model.layers.{i}.mlp.down_proj.weight" for i in range(layers)}
    holder = {hf_name[n]: s for s, b in enumerate(back) for n in b}
    assert {n: hf_stage(n, layers, stages) for n in hf} == holder


def test_a_dimension_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split over 2 tensor-parallel ranks"):
        shard(torch.zeros(3, 4), Split(0), 0, 2)


def test_bad_configs_are_refused():
    model = llama_untied_gqa()
    state = model.state_dict()
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"q/k/v_proj\.weight must be all present"):
        hf_to_megatron(state, model.config)
    model.config.num_key_value_heads = 4
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        AttentionShape.of(model.config)


PPO = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.0)


def make_actor(make: Any, layout: str | None, config: AlgorithmConfig | None = None, token_budget: int | None = None,
               **kwargs: Any) -> Actor:
    """The Megatron actor (``layout``) or the FSDP actor on ``make()``'s weights (``token_budget``:
    the micro-batches' size, the actor's default when None)."""
    config = config or PPO
    actor = (MegatronActor.from_hf(make(), config, lr=1e-2, temperature=0.7, **kwargs) if layout
             else FSDPActor.create(make(), config, lr=1e-2, temperature=0.7, **kwargs))
    actor.token_budget = token_budget or actor.token_budget
    return actor


@pytest.fixture
def megatron_parallel_state(tmp_path) -> Iterator[None]:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    from megatron.core import parallel_state

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatron_model_loads_hf_weights_and_exports_them_unchanged(megatron_parallel_state):
    from kuberl.megatron.cpu import cpu_shim
    from kuberl.megatron.model import build_gpt_model, export_hf_state, load_hf_state

    hf = qwen2()
    with cpu_shim():
        meg = build_gpt_model(hf.config)
    assert sum(p.numel() for p in meg.parameters()) == sum(p.numel() for p in hf.parameters())
    load_hf_state(meg, hf.state_dict(), hf.config)
    exported = export_hf_state(meg, hf.config)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    wrong = {**hf.state_dict(), "model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match=r"decoder\.final_layernorm\.weight"):
        load_hf_state(meg, wrong, hf.config)


@pytest.mark.parametrize("make", [qwen2, qwen3_qk_norm, qwen3_moe, lambda: qwen3_moe(norm_topk_prob=False)],
                         ids=["qwen2", "qwen3-qk-norm", "qwen3-moe", "qwen3-moe-unnormalised-top-k"])
def test_megatron_forward_matches_hf_on_cpu(megatron_parallel_state, make):
    """The GPTModel's logits are the HF model's on the same rows; packed (rows end to end under a
    block-diagonal mask, Megatron's rotary positions running on along each bin) its log-probs and
    entropy are the HF model's on the padded rows."""
    from kuberl.megatron.cpu import cpu_shim
    from kuberl.megatron.inputs import model_inputs
    from kuberl.megatron.logprobs import token_logprobs_and_entropy, vocab_parallel_logits
    from kuberl.megatron.model import build_gpt_model, load_hf_state
    from kuberl.policy.actor import token_logprobs_and_entropy as hf_logprobs_and_entropy

    hf = make().eval()
    batch = random_batch(hf.config.vocab_size, seed=1, rows=6)
    packed_rows = model_inputs([batch], packed=True, sequence_parallel=False)[0].input_ids.shape[0]
    assert packed_rows < batch.size  # rows share bins
    with cpu_shim():
        meg = build_gpt_model(hf.config)
        load_hf_state(meg, hf.state_dict(), hf.config)
        with torch.no_grad():
            got = vocab_parallel_logits(meg.eval(), model_inputs([batch], False, False)[0])
            packed = token_logprobs_and_entropy(meg, batch, 0.7, packed=True)
    with torch.no_grad():
        expected = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        expected_logp, expected_entropy = hf_logprobs_and_entropy(hf, batch, 0.7)
    valid = batch.attention_mask.bool()  # right padding: positions past a row's end are never trained
    assert torch.allclose(got[valid], expected[valid], atol=1e-5), (got[valid] - expected[valid]).abs().max()
    predicts = valid[:, 1:]  # positions whose next token is real
    for ours, theirs in zip(packed, (expected_logp, expected_entropy), strict=True):
        assert torch.allclose(ours[predicts], theirs[predicts], atol=1e-5), (ours - theirs)[predicts].abs().max()
        assert torch.all(ours[~predicts] == 0)


@pytest.mark.parametrize("make", [*MODELS, lambda: qwen3_moe(norm_topk_prob=False), lambda: qwen3_moe(top_k=3)],
                         ids=[*MODEL_IDS, "qwen3-moe-unnormalised-top-k", "qwen3-moe-top-3"])
def test_in_bfloat16_the_megatron_forward_rounds_as_the_hf_model_does(megatron_parallel_state, make):
    """In bfloat16 the GPTModel's logits are the HF model's bit for bit (the HF model as an engine holds
    it: ``kuberl.devices.placed``): norms, attention and experts compute in the HF order
    (:mod:`kuberl.megatron.layer_spec`; a token's k experts summed in float32), so a mixture of
    experts also routes every token alike. megatron-core's own order differed in the last bits of
    most logits (the MoE model's log-probs by up to 0.03)."""
    from kuberl.devices import placed
    from kuberl.megatron.cpu import cpu_shim
    from kuberl.megatron.inputs import model_inputs
    from kuberl.megatron.logprobs import vocab_parallel_logits
    from kuberl.megatron.model import build_gpt_model, load_hf_state

    hf = make().eval()
    batch = random_batch(hf.config.vocab_size, seed=2, rows=8)
    with cpu_shim():
        meg = build_gpt_model(hf.config, compute_dtype=torch.bfloat16)
        load_hf_state(meg, hf.state_dict(), hf.config)
        with torch.no_grad():
            got = vocab_parallel_logits(meg.eval(), model_inputs([batch], False, False)[0], torch.bfloat16)
    engine_model = placed(hf, "cpu", torch.bfloat16)
    with torch.no_grad():
        expected = engine_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    valid = batch.attention_mask.bool()
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got[valid], expected[valid]), (got[valid].float() - expected[valid].float()).abs().max()


def test_a_megatron_actor_reads_its_model_from_the_files_and_warms_up_from_them(megatron_parallel_state, tmp_path):
    """The trainer's Megatron actor on a model directory: the HF model built on ``meta`` stays the
    actor's weightless twin, the GPTModel's weights are the files' (a Qwen3-MoE, whose files hold one
    tensor per expert, read a layer at a time), and an SFT warm-up reads the twin from the files for
    its steps, trains it as the in-memory model trains, and puts it back on ``meta``."""
    import itertools

    from kuberl.api.spec import DatasetSource, ModelSource
    from kuberl.data.datasets import examples
    from kuberl.models.loading import load_skeleton
    from kuberl.models.meta import is_meta
    from kuberl.models.text import TextCodec
    from kuberl.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    qwen3_moe().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    skeleton, _, weights = load_skeleton(ModelSource(path=f"file://{tmp_path}"), 0)
    from_files = MegatronActor.from_hf(skeleton, PPO, lr=1e-2, temperature=0.7, weights=weights)
    in_memory = MegatronActor.from_hf(qwen3_moe(), PPO, lr=1e-2, temperature=0.7)
    assert is_meta(from_files.hf_model)
    expected = in_memory.full_state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in from_files.full_state_dict().items())

    def demonstrations() -> Any:
        return itertools.islice(examples(DatasetSource(path="builtin:arithmetic"), 0), 64)

    codec = TextCodec(tokenizer)
    losses = from_files.supervised_warm_up(codec, demonstrations(), 2, 8, 1e-3)
    assert losses == in_memory.supervised_warm_up(codec, demonstrations(), 2, 8, 1e-3) and len(losses) == 2
    assert is_meta(from_files.hf_model)
    warmed, moved = from_files.full_state_dict(), in_memory.full_state_dict()
    assert all(torch.equal(t, moved[n]) for n, t in warmed.items())
    assert any(not torch.equal(t, expected[n]) for n, t in warmed.items())


@pytest.mark.slow
def test_in_bfloat16_the_kl_reference_is_held_in_bfloat16_and_reads_as_the_policy_does(megatron_parallel_state,
                                                                                      tmp_path):
    """π_ref is held in the compute dtype (half the memory of float32), as FSDP2 holds its own: the
    forward casts every parameter to that dtype first, so it reads what the float32 policy it copies
    reads, bit for bit — at the start, after a step and π_ref := π_θ, and resumed from a checkpoint."""
    kl = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.5)
    actor = MegatronActor.from_hf(qwen2(), kl, lr=1e-2, temperature=0.7, compute_dtype=torch.bfloat16)
    assert {p.dtype for p in actor.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    batch = random_batch(qwen2().config.vocab_size, seed=3, rows=4)

    def reads(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return actor.logprobs(model, [batch])[0]

    assert torch.equal(reads(actor.reference), reads(actor.model))
    actor.train_step(batch, batch.size)
    assert not torch.equal(reads(actor.reference), reads(actor.model))
    actor.freeze_reference()
    assert torch.equal(reads(actor.reference), reads(actor.model))
    actor.save_shards(tmp_path / "ckpt")
    resumed = MegatronActor.from_hf(qwen2(), kl, lr=1e-2, temperature=0.7, compute_dtype=torch.bfloat16)
    resumed.load_shards(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(resumed.logprobs(resumed.reference, [batch])[0], reads(actor.reference))


def test_files_that_lack_weights_are_refused_up_front_naming_them(megatron_parallel_state, tmp_path):
    """A model directory missing a norm and one expert's down projection: both backends' loaders refuse
    it before converting anything, listing what is missing (Megatron raised a bare KeyError on the first
    absent tensor, in the middle of the conversion, before)."""
    from safetensors.torch import load_file, save_file

    from kuberl.api.spec import ModelSource
    from kuberl.models.loading import load_skeleton
    from kuberl.models.meta import MetaLoadError, materialize

    qwen3_moe().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    dropped = ("model.layers.1.self_attn.k_norm.weight", "model.layers.0.mlp.experts.1.down_proj.weight")
    tensors = load_file(path)
    assert all(name in tensors for name in dropped)
    save_file({n: t for n, t in tensors.items() if n not in dropped}, path, metadata={"format": "pt"})

    skeleton, _, weights = load_skeleton(ModelSource(path=f"file://{tmp_path}"), 0)
    expected = r"lack \[.*k_norm.*experts\.1\.down_proj.* \(2 weights\)"
    with pytest.raises(MetaLoadError, match=expected):
        MegatronActor.from_hf(skeleton, PPO, lr=1e-2, temperature=0.7, weights=weights)
    with pytest.raises(MetaLoadError, match=expected):
        materialize(skeleton, weights, torch.device("cpu"))


@pytest.mark.slow
def test_a_checkpoint_resumes_only_into_the_backend_that_wrote_it(megatron_parallel_state, tmp_path):
    """FSDP2's DCP shards and Megatron's sharded tensors do not load into each other: refused before
    anything is read, naming the field and what differs."""
    import psutil

    from kuberl.checkpoint import CheckpointError
    from kuberl.trainer.checkpointing import TrainerState, layout_mismatch, load_trainer, save_trainer

    fsdp, megatron = make_actor(qwen2, None), make_actor(qwen2, "megatron")
    save_trainer(fsdp, TrainerState.capture(1, 1, 0), tmp_path / "fsdp")
    save_trainer(megatron, TrainerState.capture(1, 1, 0), tmp_path / "megatron")
    # megatron-core's writer leaves no process behind (a process ending by os._exit would orphan it)
    assert [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())] == []
    assert load_trainer(make_actor(qwen2, "megatron"), tmp_path / "megatron").step == 1
    with pytest.raises(CheckpointError, match=r"spec\.trainer: .*\(backend fsdp → megatron\)"):
        load_trainer(megatron, tmp_path / "fsdp")
    with pytest.raises(CheckpointError, match=r"backend megatron → fsdp"):
        load_trainer(fsdp, tmp_path / "megatron")
    assert layout_mismatch({"backend": "fsdp"}, {"backend": "fsdp"}) is None


def test_the_trainer_refuses_a_megatron_layout_it_cannot_train_naming_the_field():
    """Should a spec reach the trainer unvalidated, it stops with the same field-naming message as
    ``kuberl validate`` (here: expert tensor parallelism, which this build's Megatron backend does not train)."""
    import yaml

    from kuberl.api.resources import RLExperiment
    from kuberl.runconfig import RunConfig
    from kuberl.trainer.loop import make_actor

    doc = yaml.safe_load((Path(__file__).parent.parent / "examples/cpu-megatron.yaml").read_text())
    doc["spec"]["trainer"] |= {"parallelism": {"tensor": 2, "expert": 2, "expertTensor": 2}, "acceleratorsPerNode": 4}
    obj = RLExperiment.model_validate(doc)  # the schema admits it; kuberl.api.support refuses it
    with pytest.raises(SystemExit, match=r"invalid spec: spec\.trainer\.parallelism\.expertTensor: is 2: backend"):
        make_actor(RunConfig("t", obj.spec), qwen2(), torch.device("cpu"))


def test_a_layout_that_does_not_fit_the_model_is_refused_by_the_trainer_naming_the_field():
    """Expert parallelism needs experts, and experts that split evenly over its ranks. ``kuberl
    validate`` does not load the model; the trainer does, and stops before it forms any group."""
    import yaml

    from kuberl.api.resources import RLExperiment
    from kuberl.megatron.model import layout_issues
    from kuberl.runconfig import RunConfig
    from kuberl.trainer.loop import make_actor

    assert layout_issues(qwen3_moe().config, expert=2) == layout_issues(qwen3_moe().config, expert=4) == []
    assert [f for f, _ in layout_issues(qwen2().config, 2)] == ["spec.trainer.parallelism.expert"]
    assert [f for f, _ in layout_issues(qwen3_moe().config, 3)] == ["spec.trainer.parallelism.expert"]
    assert layout_issues(qwen2().config, 1, pipeline=2) == []
    assert [f for f, _ in layout_issues(qwen2().config, 1, pipeline=3)] == ["spec.trainer.parallelism.pipeline"]
    doc = yaml.safe_load((Path(__file__).parent.parent / "examples/cpu-megatron-moe.yaml").read_text())
    obj = RLExperiment.model_validate(doc)
    with pytest.raises(SystemExit, match=r"spec\.trainer\.parallelism\.expert: is 2: the model has no experts"):
        make_actor(RunConfig("t", obj.spec), qwen2(), torch.device("cpu"))
