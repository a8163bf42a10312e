"""The Megatron actor against the FSDP actor, in several processes over gloo: tensor, expert, pipeline
and data parallelism (and their combinations) read, differentiate, train, checkpoint and resume as the
FSDP actor does on the same HF weights and batches, bfloat16 included, and export the same HF directory.
(Conversion and the model itself: tests/test_megatron.py.)"""

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

from kuberl.api.spec import ExportSpec
from kuberl.collectives import exit_without_teardown
from kuberl.fsdp.actor import FSDPActor
from kuberl.megatron.actor import MegatronActor
from kuberl.megatron.convert import megatron_to_hf
from kuberl.megatron.cpu import on_device
from kuberl.megatron.model import gathered, with_every_expert
from kuberl.models.tiny import chat_tokenizer
from kuberl.policy.actor import Actor, token_logprobs_and_entropy
from kuberl.policy.algorithms import AlgorithmConfig
from kuberl.policy.batch import Batch, split
from kuberl.policy.loss import ppo_loss
from kuberl.trainer.export import export_policy

from .test_megatron import PPO, make_actor, qwen2, qwen3_moe, qwen3_qk_norm, random_batch
from .workers import FREE_PORT, start_workers

DR_GRPO = AlgorithmConfig(name="drgrpo", group_size=2, kl_coef=0.0, max_new_tokens=8)  # Σ loss ÷ (rows · 8)
KL = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.5)  # with two updates a batch: π_prox and π_ref passes
# GSPO's sequence ratio (sequences averaged: Σ ÷ rows) with TIS: the loss module's other paths, on both backends
GSPO_TIS = AlgorithmConfig(name="grpo", group_size=2, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                           correction="truncate", behavior_imp_cap=0.1)  # random behaviour log-probs: w < 1
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
           "cp2-dp2": {"context_parallel_size": 2}, "cp2": {"context_parallel_size": 2},
           "pp2-cp2": {"pipeline_model_parallel_size": 2, "context_parallel_size": 2},
           "cp2-ep2": {"context_parallel_size": 2, "expert_model_parallel_size": 2},
           "cp2-tp2": {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
           "pp2-ep2-dp2": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}}


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
            if "cp2" in layout and not pipelined:
                result["packed"] = read_and_differentiate(make_actor(make, layout, packing=True), first)
        else:
            result["bf16"] = read_and_differentiate(make_actor(make, layout, compute_dtype=torch.bfloat16), first)
        budget = TOKEN_BUDGET if pipelined else None
        actor = (from_files(make, layout, Path(f"{staging}-files"), budget) if pipelined
                 else make_actor(make, layout, token_budget=budget))
        export_policy(actor, chat_tokenizer(), 0, f"file://{staging}-export/", ExportSpec(dtype="float32"),
                      Path(f"{staging}-export-staging"), None, rank)  # every rank: the pieces are gathered
        if layout and not pipelined:  # the scorer reads the whole model: not a pipeline stage
            result["first"] = read_and_differentiate(actor, first)
        data_rank, data_ranks = actor.data_parallel()
        mine = [as_collated_alone(split(b, data_ranks)[data_rank]) for b in (first, second)]
        steps = [actor.train_step(mine[0], first.size)]
        if layout:
            save_trainer(actor, TrainerState.capture(1, 1, 0), Path(staging))
            result["after_first"] = actor.full_state_dict()
        steps.append(actor.train_step(mine[1], second.size))
        result |= {"state": actor.full_state_dict(), "data_ranks": data_ranks,
                   **{key: [s[f"ppo_actor/{key[:-1]}"] for s in steps] for key in
                      ("grad_norms", "update_sizes", "update_kls")}}
        dr_grpo = make_actor(make, layout, DR_GRPO, token_budget=budget)
        result["dr_grpo_norm"] = dr_grpo.train_step(mine[0], first.size)["ppo_actor/grad_norm"]
        if layout and "cp2" in layout and pipelined:  # packed bins through the pipeline's buffers
            packed = make_actor(make, layout, token_budget=budget, packing=True)
            result["packed_norm"] = packed.train_step(mine[0], first.size)["ppo_actor/grad_norm"]
        gspo = make_actor(make, layout, GSPO_TIS, token_budget=budget)
        result["gspo_tis"] = gspo.train_step(mine[0], first.size)
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


def from_files(make: Any, layout: str | None, directory: Path, token_budget: int) -> Actor:
    """The actor as the trainer builds it from a model directory: the HF model on ``meta``
    (``load_skeleton``); Megatron (``layout``) with each rank reading its stage's layers, its experts
    and its pieces from the safetensors (a Qwen3-MoE's one tensor per expert) a layer at a time, FSDP2
    its shards."""
    from kuberl.api.spec import ModelSource
    from kuberl.models.loading import load_skeleton
    from kuberl.models.meta import is_meta

    if dist.get_rank() == 0:  # transformers saves on rank 0 only once a process group is up
        make().save_pretrained(directory)
        chat_tokenizer().save_pretrained(directory)
    dist.barrier()
    skeleton, _, weights = load_skeleton(ModelSource(path=f"file://{directory}"), 0)
    assert is_meta(skeleton)
    actor = (MegatronActor.from_hf(skeleton, PPO, lr=1e-2, temperature=0.7, weights=weights) if layout
             else FSDPActor.create(skeleton, PPO, lr=1e-2, temperature=0.7, weights=weights))
    actor.token_budget = token_budget
    return actor


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
        start_workers(_train_two_steps, procs, (procs, FREE_PORT, model, megatron_layout,
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
    # the update's size over every piece counted once (split, experts, ZeRO-owned; measured ≤ 2e-4 relative)
    assert megatron["update_sizes"] == pytest.approx(fsdp["update_sizes"], rel=1e-3) and min(fsdp["update_sizes"]) > 0
    if megatron["data_ranks"] == 1:  # the same probe rows (with data parallelism each rank probes its own)
        assert megatron["update_kls"] == pytest.approx(fsdp["update_kls"], rel=1e-2) and min(fsdp["update_kls"]) > 0
    assert megatron["dr_grpo_norm"] == pytest.approx(fsdp["dr_grpo_norm"], rel=1e-4)  # its constant normaliser too
    assert fsdp["gspo_tis"]["mismatch/truncated_fraction"] > 0  # the truncation is exercised
    assert megatron["gspo_tis"]["ppo_actor/grad_norm"] == pytest.approx(  # GSPO + TIS: the same gradient
        fsdp["gspo_tis"]["ppo_actor/grad_norm"], rel=1e-4)  # (loss and means: this rank's rows only)
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_context_parallelism_reads_trains_and_resumes_as_the_fsdp_actor_does(tmp_path):
    """Context parallelism 2 × data parallelism 2 (four processes over gloo): each rank of a
    context-parallel pair holds two of the four chunks of every row (Megatron's load-balanced order,
    which its rotary embedding follows), its attention gathering the keys and values of the whole row
    — the FSDP actor's log-probs, entropy, loss and gradient for every HF parameter, padded and packed
    (several rows in a bin, the bins split between the pair); the same two steps, gradient norms and
    a bit-identical resume (the pair holds the same weights: each piece saved once)."""
    fsdp, megatron = train_both(tmp_path, "qwen2", "cp2-dp2", world=4)
    first = random_batch(qwen2().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen2(tied=False), megatron["first"], first)
    assert_reads_and_differentiates_as_hf(qwen2(tied=False), megatron["packed"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen2(tied=False).state_dict())


@pytest.mark.parametrize("layout", ["cp2-tp2", "cp2-ep2"])
@pytest.mark.slow
def test_context_parallelism_trains_a_mixture_of_experts_as_the_fsdp_actor_does(tmp_path, layout):
    """Context parallelism 2 on Qwen3-MoE (four processes): each rank of a context-parallel pair takes
    its two chunks of every row, and within them — with tensor parallelism 2, under sequence
    parallelism — its tensor-parallel half of the tokens through norms, router and experts, or — with
    expert parallelism 2 — its tokens to the ranks holding their experts: the FSDP actor's log-probs,
    loss and gradients, padded and packed, and its two steps and resume."""
    fsdp, megatron = train_both(tmp_path, "qwen3-moe", layout, world=4)
    first = random_batch(qwen3_moe().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen3_moe(), megatron["first"], first)
    assert_reads_and_differentiates_as_hf(qwen3_moe(), megatron["packed"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen3_moe().state_dict())


@pytest.mark.slow
def test_context_parallelism_through_the_pipeline_trains_as_the_fsdp_actor_does(tmp_path):
    """Pipeline 2 × context 2 (four processes, tied embeddings): each stage's p2p buffers carry a
    rank's half of every row; the FSDP actor's two steps, gradient norms and KL stats with π_prox and
    π_ref read through the pipeline, a bit-identical resume, and packed rows through the pipeline give
    its first gradient norm."""
    fsdp, megatron = train_both(tmp_path, "qwen2-tied", "pp2-cp2", world=4)
    assert_trains_as_fsdp(fsdp, megatron, qwen2().state_dict(), with_kl=True)
    assert megatron["packed_norm"] == pytest.approx(fsdp["grad_norms"][0], rel=1e-4)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_mixture_of_experts_with_tensor_and_sequence_parallelism_trains_as_the_fsdp_actor_does(tmp_path):
    """Qwen3-MoE with tensor parallelism 2, which Megatron runs with sequence parallelism: each rank
    holds half the attention heads and takes half of each row's tokens through its norms, router and
    experts (every expert whole on both ranks; the rows padded to an even width) — the FSDP actor's
    log-probs, loss, gradients (norms and router summed over the ranks), two steps and a resume."""
    fsdp, megatron = train_both(tmp_path, "qwen3-moe", "tp2", world=2)
    first = random_batch(qwen3_moe().config.vocab_size, seed=6, rows=6)
    assert_reads_and_differentiates_as_hf(qwen3_moe(), megatron["first"], first)
    assert_trains_as_fsdp(fsdp, megatron, qwen3_moe().state_dict())


@pytest.mark.slow
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


@pytest.mark.slow
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
    start_workers(_resume_elsewhere, 2, (2, FREE_PORT, "qwen3-moe", "tp2", str(tmp_path / "staging-pp2-ep2-dp2"),
                                        str(out)))
    elsewhere = torch.load(out)
    assert elsewhere["loaded"].keys() == megatron["after_first"].keys()
    assert all(torch.equal(elsewhere["loaded"][n], t) for n, t in megatron["after_first"].items())
    start = megatron["after_first"]
    for name, weights in megatron["state"].items():  # the second step: as in assert_trains_as_fsdp
        change, other = weights - start[name], elsewhere["state"][name] - start[name]
        assert (other - change).norm() <= 1e-2 * change.norm(), name


def _read_in_bfloat16(rank: int, world: int, port: int, out: str) -> None:
    """Expert parallelism over ``world`` ranks (each the same rows): rank 0 saves the bfloat16 logits."""
    from megatron.core import parallel_state

    from kuberl.megatron.inputs import model_inputs
    from kuberl.megatron.logprobs import vocab_parallel_logits

    with gloo_world(rank, world, port):
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        actor = make_actor(lambda: qwen3_moe(top_k=3), "ep2", compute_dtype=torch.bfloat16)
        batch = random_batch(actor.hf_config.vocab_size, seed=8, rows=8)
        with torch.no_grad(), on_device(actor.device):
            logits = vocab_parallel_logits(actor.model.eval(), model_inputs([batch], False, False)[0], torch.bfloat16)
        if rank == 0:
            torch.save(logits, out)
    exit_without_teardown(0)


@pytest.mark.slow
def test_with_expert_parallelism_the_bfloat16_forward_still_rounds_as_the_hf_model_does(tmp_path):
    """Qwen3-MoE, top 3 of 4 experts, expert parallelism 2: a token's experts sit on both ranks, each
    rank sums its own and the combine adds the two sums — in float32, rounded once as the HF model
    rounds its sum of k (:func:`kuberl.megatron.layer_spec.experts_weighted_after`): the bfloat16
    logits equal the HF model's bit for bit (summed in bfloat16 on each rank and again across them,
    they did not)."""
    from kuberl.devices import placed

    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")
    out = tmp_path / "logits.pt"
    start_workers(_read_in_bfloat16, 2, (2, FREE_PORT, str(out)))
    got = torch.load(out)
    hf = placed(qwen3_moe(top_k=3).eval(), "cpu", torch.bfloat16)
    batch = random_batch(hf.config.vocab_size, seed=8, rows=8)
    with torch.no_grad():
        expected = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    valid = batch.attention_mask.bool()
    assert torch.equal(got[: batch.size, : valid.shape[1]][valid], expected[valid]), (
        (got[: batch.size, : valid.shape[1]][valid].float() - expected[valid].float()).abs().max())
