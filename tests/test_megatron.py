"""The Megatron-core backend on CPU: HF ↔ Megatron conversion (pure), the tensor-parallel split, and
a real megatron-core GPTModel (through ``kuberl.megatron.cpu.cpu_shim``) loaded from HF weights,
exported back bit for bit, giving the HF model's logits, and — with tensor parallelism 2 in two
processes over gloo — the FSDP actor's log-probs, entropy, decoupled-PPO loss and gradients."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
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

from kuberl.api.spec import ExportSpec
from kuberl.collectives import exit_without_teardown
from kuberl.local_processes import free_port
from kuberl.megatron.actor import MegatronActor
from kuberl.megatron.convert import AttentionShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from kuberl.megatron.cpu import on_device
from kuberl.megatron.model import gathered, with_every_expert
from kuberl.megatron.tensor_parallel import Split, shard, unshard
from kuberl.models.tiny import char_tokenizer, chat_tokenizer, tiny_qwen2
from kuberl.rollout.types import Trajectory
from kuberl.trainer.actor import Actor, token_logprobs_and_entropy
from kuberl.trainer.algorithms import AlgorithmConfig
from kuberl.trainer.batch import Batch, collate, split
from kuberl.trainer.export import export_policy
from kuberl.trainer.loss import ppo_loss

from .workers import start_workers


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


def qwen3_moe(norm_topk_prob: bool = True) -> torch.nn.Module:
    """Qwen3-MoE: 4 routed experts, top-2, in every layer; its stacked expert weights and q/k norms
    random (at init the experts are zeros here, and a mixed-up expert order would go unseen)."""
    config = Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
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
    from kuberl.megatron.pipeline import EMBEDDING, OUTPUT_LAYER, global_state, hf_stage, stage_state

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
    from kuberl.megatron.cpu import cpu_shim
    from kuberl.megatron.logprobs import vocab_parallel_logits
    from kuberl.megatron.model import build_gpt_model, load_hf_state

    hf = make().eval()
    batch = random_batch(hf.config.vocab_size, seed=1)
    with cpu_shim():
        meg = build_gpt_model(hf.config)
        load_hf_state(meg, hf.state_dict(), hf.config)
        with torch.no_grad():
            got = vocab_parallel_logits(meg.eval(), batch)
    with torch.no_grad():
        expected = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    valid = batch.attention_mask.bool()  # right padding: positions past a row's end are never trained
    assert torch.allclose(got[valid], expected[valid], atol=1e-5), (got[valid] - expected[valid]).abs().max()


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


PPO = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.0)
DR_GRPO = AlgorithmConfig(name="drgrpo", group_size=2, kl_coef=0.0, max_new_tokens=8)  # Σ loss ÷ (rows · 8)
KL = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.5)  # with two updates a batch: π_prox and π_ref passes
TOKEN_BUDGET = 24  # rows of ≤ 13 tokens: one or two a micro-batch, several through a pipeline


def read_and_differentiate(actor: Actor, batch: Batch) -> dict[str, Any]:
    """What the actor's backend reads from its model for ``batch`` — per-token log-probs and entropy —
    and the decoupled-PPO loss and its gradient under HF names (Megatron: gathered over the
    tensor-parallel ranks), without an optimizer step."""
    logp, entropy = actor.scorer(actor.model, batch, actor.temperature)
    loss = ppo_loss(logp, logp.detach(), batch.behav_logp, batch.advantages, batch.loss_mask, PPO).loss
    with on_device(actor.device):  # as MegatronActor.train_step
        loss.backward()
    actor.clip_gradients(list(actor.model.parameters()), float("inf"))  # completes them, as in train_step
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: DTensors
             for n, p in actor.model.named_parameters()}
    if isinstance(actor, MegatronActor):
        grads = megatron_to_hf(with_every_expert(gathered(actor.model, grads), actor.hf_config), actor.hf_config)
    actor.optimizer.zero_grad(set_to_none=True)
    return {"logp": logp.detach(), "entropy": entropy, "loss": loss.detach(), "grads": grads}


def as_collated_alone(batch: Batch) -> Batch:
    """``batch`` as the trainer loop gives a data-parallel rank its rows: collated on their own, so
    only as wide as their longest row (the ranks' widths differ)."""
    width = int(batch.attention_mask.sum(1).max())  # the longest row's tokens

    def cut(t: torch.Tensor) -> torch.Tensor:  # [B] as it is; [B, L] → width columns, [B, L−1] → width − 1
        return t if t.dim() == 1 else t[:, :width - (batch.input_ids.shape[1] - t.shape[1])]

    return Batch(*(cut(getattr(batch, f.name)) for f in fields(batch)))


MODELS_TRAINED = {"qwen2": lambda: qwen2(tied=False), "qwen2-tied": qwen2, "qwen3-moe": qwen3_moe}
LAYOUTS = {"tp2-dp2": {"tensor_model_parallel_size": 2}, "ep2-dp2": {"expert_model_parallel_size": 2},
           "tp2": {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
           "pp2": {"pipeline_model_parallel_size": 2},
           "pp2-ep2-dp2": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}}


def make_actor(make: Any, layout: str | None, config: AlgorithmConfig | None = None, token_budget: int | None = None,
               **kwargs: Any) -> Actor:
    """The Megatron actor (``layout``) or the FSDP actor on ``make()``'s weights (``token_budget``:
    the micro-batches' size, the actor's default when None)."""
    config = config or PPO
    actor = (MegatronActor.from_hf(make(), config, lr=1e-2, temperature=0.7, **kwargs) if layout
             else Actor.create(make(), config, lr=1e-2, temperature=0.7, **kwargs))
    actor.token_budget = token_budget or actor.token_budget
    return actor


@contextlib.contextmanager
def gloo_world(rank: int, world: int, port: int) -> Iterator[None]:
    """This spawned process as rank ``rank`` of a gloo world on the loopback, one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train_two_steps(rank: int, world: int, port: int, model: str, layout: str | None, staging: str,
                     out: str, pipelined: bool) -> None:
    """Two decoupled-PPO steps on two batches: the FSDP actor (``layout`` None, ``world`` 1) or the
    Megatron actor laid out as ``LAYOUTS[layout]`` over ``world`` ranks (each data-parallel rank
    trains on its share of the rows, as the trainer loop splits them), which also checkpoints after
    the first step and then takes the second step again from that checkpoint in a new actor; rank 0
    saves the weights under HF names. ``pipelined`` (a pipeline layout, and the FSDP run it is
    compared with): several micro-batches a step, and without data parallelism also a KL term with
    two updates a batch (π_prox and π_ref read through the pipeline)."""
    from kuberl.trainer.checkpointing import TrainerState, load_trainer, save_trainer

    make = MODELS_TRAINED[model]
    with gloo_world(rank, world, port):
        first, second = (random_batch(make().config.vocab_size, seed=s, rows=6) for s in (6, 7))
        result: dict[str, Any] = {}
        if layout:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(**LAYOUTS[layout])
            if layout == "tp2-dp2":
                qwen3 = MegatronActor.from_hf(qwen3_qk_norm(tied=False), PPO, lr=1e-2, temperature=0.7)
                result["qwen3"] = read_and_differentiate(qwen3, first)
                result["bf16"] = read_and_differentiate(make_actor(make, layout, compute_dtype=torch.bfloat16), first)
        else:
            result["bf16"] = read_and_differentiate(make_actor(make, layout, compute_dtype=torch.bfloat16), first)
        budget = TOKEN_BUDGET if pipelined else None
        actor = make_actor(make, layout, token_budget=budget)
        export_policy(actor, chat_tokenizer(), 0, f"file://{staging}-export/", ExportSpec(dtype="float32"),
                      Path(f"{staging}-export-staging"), None, rank)  # every rank: the pieces are gathered
        if layout and not pipelined:  # the scorer reads the whole model: not a pipeline stage
            result["first"] = read_and_differentiate(actor, first)
        data_rank, data_ranks = actor.data_parallel()
        mine = [as_collated_alone(split(b, data_ranks)[data_rank]) for b in (first, second)]
        norms = [actor.train_step(mine[0], first.size)["ppo_actor/grad_norm"]]
        if layout:
            save_trainer(actor, TrainerState.capture(1, 1, 0), Path(staging))
            result["after_first"] = actor.full_state_dict()
        norms.append(actor.train_step(mine[1], second.size)["ppo_actor/grad_norm"])
        result |= {"state": actor.full_state_dict(), "grad_norms": norms}
        dr_grpo = make_actor(make, layout, DR_GRPO, token_budget=budget)
        result["dr_grpo_norm"] = dr_grpo.train_step(mine[0], first.size)["ppo_actor/grad_norm"]
        if pipelined and data_ranks == 1:  # two updates a batch split alike: the same rows in each
            kl = make_actor(make, layout, KL, token_budget=budget, mini_batches=2)
            kl.freeze_reference()
            result["kl_stats"] = [kl.train_step(b, first.size) for b in mine]
        if layout:
            resumed = make_actor(make, layout, token_budget=budget)
            assert load_trainer(resumed, Path(staging)).step == 1
            resumed.train_step(mine[1], second.size)
            result["resumed"] = resumed.full_state_dict()
        if rank == 0:
            torch.save(result, out)
    exit_without_teardown(0)


def _resume_elsewhere(rank: int, world: int, port: int, model: str, layout: str, staging: str, out: str) -> None:
    """The Megatron actor laid out as ``LAYOUTS[layout]`` resumes from a checkpoint another layout
    wrote after the first step of :func:`_train_two_steps` and takes the second; rank 0 saves the
    weights it loaded and the weights after that step."""
    from megatron.core import parallel_state

    from kuberl.trainer.checkpointing import load_trainer

    with gloo_world(rank, world, port):
        make = MODELS_TRAINED[model]
        second = random_batch(make().config.vocab_size, seed=7, rows=6)
        parallel_state.initialize_model_parallel(**LAYOUTS[layout])
        actor = make_actor(make, layout)
        assert load_trainer(actor, Path(staging)).step == 1
        result = {"loaded": actor.full_state_dict()}
        data_rank, data_ranks = actor.data_parallel()
        actor.train_step(as_collated_alone(split(second, data_ranks)[data_rank]), second.size)
        result["state"] = actor.full_state_dict()
        if rank == 0:
            torch.save(result, out)
    exit_without_teardown(0)


def parallel_state_stages(layout: str | None) -> int:
    return LAYOUTS.get(layout or "", {}).get("pipeline_model_parallel_size", 1)


def train_both(tmp_path: Path, model: str, layout: str, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the FSDP actor's run, the Megatron actor's run) of :func:`_train_two_steps`."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    runs, pipelined = [], parallel_state_stages(layout) > 1
    for name, procs, megatron_layout in (("fsdp", 1, None), (layout, world, layout)):
        out = tmp_path / f"{name}.pt"
        start_workers(_train_two_steps, procs, (procs, free_port(), model, megatron_layout,
                                                str(tmp_path / f"staging-{name}"), str(out), pipelined))
        runs.append(torch.load(out))
    return runs[0], runs[1]


def assert_reads_and_differentiates_as_hf(hf: torch.nn.Module, got: dict[str, Any], batch: Batch) -> None:
    """``got`` (:func:`read_and_differentiate`) against the FSDP actor's own functions on the HF model."""
    logp, entropy = token_logprobs_and_entropy(hf, batch, temperature=0.7)
    loss = ppo_loss(logp, logp.detach(), batch.behav_logp, batch.advantages, batch.loss_mask, PPO).loss
    loss.backward()
    trained = batch.loss_mask.bool()
    assert torch.allclose(got["logp"][trained], logp.detach()[trained], atol=1e-5)
    assert torch.allclose(got["entropy"][trained], entropy[trained], atol=1e-5)
    assert torch.allclose(got["loss"], loss.detach(), atol=1e-6)
    for name, param in hf.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
        assert torch.allclose(got["grads"][name], param.grad, atol=1e-6, rtol=1e-4), name


def assert_trains_as_fsdp(fsdp: dict[str, Any], megatron: dict[str, Any], start: dict[str, torch.Tensor],
                          with_kl: bool = False) -> None:
    """The same gradient norms (clipped at 1.0: exercised), the same two updates, and a resumed second
    step bit-identical to the uninterrupted one; ``with_kl``: also, with the KL term and two updates a
    batch (π_prox and π_ref read before the updates), the same stats."""
    assert fsdp["grad_norms"][0] > 1.0  # the clipping is exercised
    assert megatron["grad_norms"] == pytest.approx(fsdp["grad_norms"], rel=1e-4)
    assert megatron["dr_grpo_norm"] == pytest.approx(fsdp["dr_grpo_norm"], rel=1e-4)  # its constant normaliser too
    if with_kl:
        assert fsdp["kl_stats"][1]["ppo_actor/kl"] > 0  # π_ref is read: the second update's policy has moved
        compared = ("ppo_actor/grad_norm", "ppo_actor/entropy", "mismatch/behav_logp_gap", "ppo_actor/loss",
                    "ppo_actor/kl")
        for got, expected in zip(megatron["kl_stats"], fsdp["kl_stats"], strict=True):  # measured ≤ 2e-4 relative
            assert {k: got[k] for k in compared} == pytest.approx({k: expected[k] for k in compared}, rel=1e-3)
    assert fsdp["state"].keys() == megatron["state"].keys() == megatron["resumed"].keys() == start.keys()
    for name, weights in fsdp["state"].items():
        change, other = weights - start[name], megatron["state"][name] - start[name]
        assert change.norm() > 0, f"{name} did not train"
        # Adam turns float noise in a near-zero gradient into a step of up to lr, so compare the
        # updates as a whole: measured ≤ 3e-4 relative
        assert (other - change).norm() <= 1e-2 * change.norm(), name
        assert torch.equal(megatron["resumed"][name], megatron["state"][name]), name


def test_the_megatron_actor_reads_trains_and_resumes_as_the_fsdp_actor_does(tmp_path):
    """Megatron with tensor parallelism 2 × data parallelism 2 (four processes over gloo,
    vocabulary-parallel logits, each data-parallel pair on half the rows) against
    the FSDP actor's own functions on the same HF weights and batch: the same per-token log-probs and
    entropy, the same decoupled-PPO loss, the same gradient for every HF parameter (the untied output
    layer is split over the vocabulary too; a tied model trains in tests/test_local_run.py) — for
    Qwen2 and for Qwen3, whose q/k norms each rank feeds only its own heads. Then the
    same two optimizer steps (AdamW, gradient clipping at 1.0, the decoupled-PPO loss) from the
    same weights on the same batches: the Megatron actor with tensor parallelism 2, its gradients
    averaged over the two data-parallel halves of each batch, sees the FSDP actor's (one process,
    every row) gradient norms and ends at its weights. Each tensor-parallel rank checkpoints its pieces
    and optimizer state (Megatron's sharded tensors): the second step taken again after a
    resume gives bit-identical weights."""
    fsdp, megatron = train_both(tmp_path, "qwen2", "tp2-dp2", world=4)
    first = random_batch(qwen2().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen2(tied=False), megatron["first"], first)
    assert_reads_and_differentiates_as_hf(qwen3_qk_norm(tied=False), megatron["qwen3"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen2(tied=False).state_dict())
    assert_computes_in_bfloat16_as_fsdp(fsdp["bf16"], megatron["bf16"], megatron["first"], first)


def assert_computes_in_bfloat16_as_fsdp(fsdp: dict[str, Any], megatron: dict[str, Any], fp32: dict[str, Any],
                                        batch: Batch) -> None:
    """``model.dtype: bfloat16`` (auto on GPUs and NPUs) on Megatron as on FSDP2: the forward and
    backward run in bfloat16 — the log-probs moved off the float32 ones by bfloat16 rounding — and
    agree with FSDP2 mixed precision's to that rounding (they add up the same products in another
    order: fused q/k/v, vocabulary halves), gradients float32 on float32 parameters, the same within
    a few percent. Measured: log-probs 0.006 off float32 and 0.0065 apart, gradients 0.8 % apart,
    losses 2.4e-5 apart."""
    trained = batch.loss_mask.bool()
    off_fp32 = (megatron["logp"][trained] - fp32["logp"][trained]).abs().max()
    apart = (megatron["logp"][trained] - fsdp["logp"][trained]).abs().max()
    assert off_fp32 > 1e-3 and apart < 0.03, (off_fp32, apart)
    assert torch.allclose(megatron["loss"], fsdp["loss"], atol=1e-3)
    assert all(g.dtype == torch.float32 for g in megatron["grads"].values())
    both = [(megatron["grads"][n].flatten(), g.flatten()) for n, g in fsdp["grads"].items()]
    difference = torch.cat([m - f for m, f in both]).norm() / torch.cat([f for _, f in both]).norm()
    assert difference < 0.03, difference


def test_the_megatron_actor_with_expert_parallelism_trains_a_mixture_of_experts_as_the_fsdp_actor_does(tmp_path):
    """Qwen3-MoE (4 experts, top 2) with expert parallelism 2 — two processes, each holding two of
    every layer's experts, tokens exchanged between them by Megatron's all-gather dispatcher — and
    data parallelism 2 (each rank on half the rows): the FSDP actor's log-probs, entropy, loss and
    gradient for every HF parameter (the experts' gathered from both ranks), the same two steps and
    gradient norms, and a bit-identical resume."""
    fsdp, megatron = train_both(tmp_path, "qwen3-moe", "ep2-dp2", world=2)
    first = random_batch(qwen3_moe().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen3_moe(), megatron["first"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen3_moe().state_dict())


def test_a_mixture_of_experts_with_tensor_and_sequence_parallelism_trains_as_the_fsdp_actor_does(tmp_path):
    """Qwen3-MoE with tensor parallelism 2, which Megatron runs with sequence parallelism: each rank
    holds half the attention heads and takes half of each row's tokens through its norms, router and
    experts (every expert whole on both ranks; the rows padded to an even width) — the FSDP actor's
    log-probs, loss, gradients (norms and router summed over the ranks), two steps and a resume."""
    fsdp, megatron = train_both(tmp_path, "qwen3-moe", "tp2", world=2)
    first = random_batch(qwen3_moe().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen3_moe(), megatron["first"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen3_moe().state_dict())


def test_pipeline_parallelism_trains_a_tied_model_as_the_fsdp_actor_does(tmp_path):
    """Pipeline parallelism 2 (two processes, one layer each; the first holds the embedding, the last
    the final norm and its own copy of the tied embedding as the output layer) through Megatron's
    1F1B schedule, several micro-batches a step: the FSDP actor's two steps and gradient norms (the
    two copies' gradients summed, counted once), the same stats reported by rank 0 — which holds no
    loss: the last stage's — with π_prox and π_ref read through the pipeline, and a bit-identical resume."""
    fsdp, megatron = train_both(tmp_path, "qwen2-tied", "pp2", world=2)
    assert_trains_as_fsdp(fsdp, megatron, qwen2().state_dict(), with_kl=True)


def assert_exports_equal(fsdp: Path, megatron: Path) -> None:
    """The HF directories (spec.export) the two backends wrote of the same weights: the same files, config
    and tensors (Megatron's stages, expert shards and fused projections back under HF names)."""
    from safetensors.torch import load_file

    fsdp, megatron = fsdp / "hf" / "step-00000000", megatron / "hf" / "step-00000000"
    files = sorted(p.name for p in fsdp.iterdir())
    assert files == sorted(p.name for p in megatron.iterdir()) and "model.safetensors" in files
    assert json.loads((fsdp / "config.json").read_text()) == json.loads((megatron / "config.json").read_text())
    ours, theirs = load_file(fsdp / "model.safetensors"), load_file(megatron / "model.safetensors")
    assert ours.keys() == theirs.keys() and any(".mlp.experts." in name for name in ours)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_mixture_of_experts_in_pipeline_stages_with_expert_parallelism_trains_as_the_fsdp_actor_does(tmp_path):
    """The shape of the Ascend Qwen3-MoE layout (``ffn:d1p4e8``) in small: pipeline 2 × expert 2 ×
    data 2 in four processes — each stage one layer, each of its ranks two of its four experts and
    half the rows — gives the FSDP actor's two steps, gradient norms and a bit-identical resume. Its
    checkpoint (``dist_checkpointing``: every piece under its whole-model key) also resumes into
    another layout — tensor 2 with sequence parallelism, one stage, every expert on every rank — with
    exactly the weights it saved, AdamW's moments and step count too: that layout's second step is
    the uninterrupted run's."""
    fsdp, megatron = train_both(tmp_path, "qwen3-moe", "pp2-ep2-dp2", world=4)
    assert_trains_as_fsdp(fsdp, megatron, qwen3_moe().state_dict())
    assert_exports_equal(tmp_path / "staging-fsdp-export", tmp_path / "staging-pp2-ep2-dp2-export")
    out = tmp_path / "elsewhere.pt"
    start_workers(_resume_elsewhere, 2, (2, free_port(), "qwen3-moe", "tp2", str(tmp_path / "staging-pp2-ep2-dp2"),
                                        str(out)))
    elsewhere = torch.load(out)
    assert elsewhere["loaded"].keys() == megatron["after_first"].keys()
    assert all(torch.equal(elsewhere["loaded"][n], t) for n, t in megatron["after_first"].items())
    start = megatron["after_first"]
    for name, weights in megatron["state"].items():  # the second step: as in assert_trains_as_fsdp
        change, other = weights - start[name], elsewhere["state"][name] - start[name]
        assert (other - change).norm() <= 1e-2 * change.norm(), name


def test_the_trainer_refuses_a_megatron_layout_it_cannot_train_naming_the_field():
    """Should a spec reach the trainer unvalidated, it stops with the same field-naming message as
    ``kuberl validate`` (here: expert tensor parallelism, which this build's Megatron backend does not train)."""
    from types import SimpleNamespace

    import yaml

    from kuberl.api.resources import RLExperiment
    from kuberl.trainer.loop import make_actor

    doc = yaml.safe_load((Path(__file__).parent.parent / "examples/cpu-megatron.yaml").read_text())
    doc["spec"]["trainer"] |= {"parallelism": {"tensor": 2, "expert": 2, "expertTensor": 2}, "acceleratorsPerNode": 4}
    obj = RLExperiment.model_validate(doc)  # the schema admits it; kuberl.api.support refuses it
    with pytest.raises(SystemExit, match=r"invalid spec: spec\.trainer\.parallelism\.expertTensor: is 2: backend"):
        make_actor(SimpleNamespace(spec=obj.spec), qwen2(), torch.device("cpu"))


def test_a_layout_that_does_not_fit_the_model_is_refused_by_the_trainer_naming_the_field():
    """Expert parallelism needs experts, and experts that split evenly over its ranks. ``kuberl
    validate`` does not load the model; the trainer does, and stops before it forms any group."""
    from types import SimpleNamespace

    import yaml

    from kuberl.api.resources import RLExperiment
    from kuberl.megatron.model import layout_issues
    from kuberl.trainer.loop import make_actor

    assert layout_issues(qwen3_moe().config, expert=2) == layout_issues(qwen3_moe().config, expert=4) == []
    assert [f for f, _ in layout_issues(qwen2().config, 2)] == ["spec.trainer.parallelism.expert"]
    assert [f for f, _ in layout_issues(qwen3_moe().config, 3)] == ["spec.trainer.parallelism.expert"]
    assert layout_issues(qwen2().config, 1, pipeline=2) == []
    assert [f for f, _ in layout_issues(qwen2().config, 1, pipeline=3)] == ["spec.trainer.parallelism.pipeline"]
    doc = yaml.safe_load((Path(__file__).parent.parent / "examples/cpu-megatron-moe.yaml").read_text())
    obj = RLExperiment.model_validate(doc)
    with pytest.raises(SystemExit, match=r"spec\.trainer\.parallelism\.expert: is 2: the model has no experts"):
        make_actor(SimpleNamespace(spec=obj.spec), qwen2(), torch.device("cpu"))
