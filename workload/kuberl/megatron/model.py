"""Build a Megatron-core ``GPTModel`` for an HF config and load HF weights into it.

Needs ``megatron-core`` (imported here, not at package import) and an initialised
``megatron.core.parallel_state``. Uses Megatron's local (non-Transformer-Engine) layer spec, whose
parameter names :mod:`.convert` maps. With tensor parallelism each rank loads its piece of every
split parameter (:mod:`.tensor_parallel`), with expert parallelism its own experts
(:mod:`.expert_parallel`), and the export gathers them back. On CPU, build and run the model inside
:func:`kuberl.megatron.cpu.cpu_shim`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .convert import (
    AttentionShape,
    experts,
    global_tensors,
    layer_tensors,
    megatron_to_hf,
    tied,
    transformer_config_kwargs,
)
from .expert_parallel import expert_of, experts_per_rank, global_name, local_state
from .layer_spec import block_spec
from .pipeline import global_state, layers_per_stage, stage_globals, stage_state
from .tensor_parallel import shard, split_of, unshard

PARTIAL_GRADIENT_SUFFIXES = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def _tensor_parallel() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _expert_parallel() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_group())


def _pipeline() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_group())


def layout_issues(hf_config: Any, expert: int, pipeline: int = 1) -> list[tuple[str, str]]:
    """(field, message) for a layout ``hf_config`` cannot be trained with: expert parallelism needs
    experts, and experts that split evenly over its ranks; pipeline stages need layers that split
    evenly over them."""
    count, issues = experts(hf_config), []
    if expert > 1 and not count:
        issues.append(("spec.trainer.parallelism.expert", f"is {expert}: the model has no experts (a dense model)"))
    elif count and count % expert:
        issues.append(("spec.trainer.parallelism.expert", f"is {expert}: the model's {count} experts do not split "
                       "evenly over it"))
    if hf_config.num_hidden_layers % pipeline:
        issues.append(("spec.trainer.parallelism.pipeline", f"is {pipeline}: the model's "
                       f"{hf_config.num_hidden_layers} layers do not split evenly over it"))
    return issues


def _left_to_the_weights(_tensor: torch.Tensor) -> None:
    """No initialisation: :func:`load_hf_state` overwrites every parameter (and refuses to leave one)."""


def build_gpt_model(hf_config: Any, seed: int = 0, compute_dtype: torch.dtype = torch.float32) -> Any:
    """A GPTModel shaped like ``hf_config``, its weights float32 whatever ``compute_dtype``
    (:func:`.logprobs.vocab_parallel_logits` casts them for the forward) and uninitialised until
    :func:`load_hf_state` fills them: megatron-core's CPU initialisation draws every split weight whole
    on every rank, a whole pipeline stage of random numbers that the files then overwrite. Seeds
    Megatron's per-rank RNG streams (``model_parallel_cuda_manual_seed``) first."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _, tensor, _ = _tensor_parallel()
    stage, stages, _ = _pipeline()
    config = TransformerConfig(**transformer_config_kwargs(hf_config, compute_dtype), tensor_model_parallel_size=tensor,
                               expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
                               sequence_parallel=tensor > 1 and experts(hf_config) > 0,
                               pipeline_model_parallel_size=stages, pipeline_dtype=compute_dtype,
                               context_parallel_size=parallel_state.get_context_parallel_world_size(),
                               calculate_per_token_loss=True, init_method=_left_to_the_weights,
                               output_layer_init_method=_left_to_the_weights,
                               embedding_init_method=_left_to_the_weights)  # fmt: skip
    if config.num_moe_experts:
        _router_without_transformer_engine()
    model = GPTModel(
        config, block_spec(config), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=tied(hf_config),
        pre_process=stage == 0, post_process=stage == stages - 1,
    )  # fmt: skip
    for name, param in model.named_parameters():
        if name.endswith(PARTIAL_GRADIENT_SUFFIXES):
            param.partial_gradient = True
        if expert_of(name) is not None:
            param.expert_parallel = True  # this expert-parallel rank's own: reduced over other groups
    return model


def _router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm``, a name its module defines only when
    Transformer Engine imports: without TE (CPU, images without it) that is a NameError. None selects
    its torch GEMM, as the module means to."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def sum_partial_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum, over the tensor-parallel ranks, the gradients of the parameters every rank holds whole but
    feeds only a part of (as Megatron's ``finalize_model_grads`` does): ``partial_gradient`` ones (q/k
    norms: the rank's attention heads) and, with sequence parallelism, ``sequence_parallel`` ones
    (norms, the router: the rank's slice of the tokens)."""
    _, size, group = _tensor_parallel()
    if size > 1:
        all_reduce_in_place([p.grad for p in params if p.grad is not None and (
            getattr(p, "partial_gradient", False) or getattr(p, "sequence_parallel", False))], group)


def sum_shared_embedding_gradients(model: Any) -> None:
    """With tied embeddings over more than one pipeline stage: g ← g_first + g_last for the first
    stage's embedding and the last stage's copy of it (Megatron's embedding group), so that both
    copies take the same step and stay equal."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, stages, _ = _pipeline()
    if stages == 1 or not model.share_embeddings_and_output_weights or not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def all_reduce_in_place(tensors: list[torch.Tensor], group: Any, divisor: int = 1) -> None:
    """t ← (Σ_group t) / ``divisor`` for every tensor, through one flat buffer (one collective per call)."""
    import torch.distributed as dist

    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat /= divisor
    for tensor, reduced in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        tensor.copy_(reduced.view_as(tensor))


def load_hf_state(model: Any, state: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy an HF state into ``model``: this tensor-parallel rank's piece of each parameter and this
    expert-parallel rank's experts (whole on every tensor-parallel rank: expert tensor parallelism is
    1), this pipeline stage's layers; every parameter must be set. ``state`` is read a layer at a time
    (:func:`_stage_pieces`): from a :class:`kuberl.models.meta.FileState` a rank holds one layer's
    whole tensors besides its own pieces, never the model."""
    rank, size, _ = _tensor_parallel()
    gated = model.config.gated_linear_unit
    params, loaded = dict(model.named_parameters()), set()
    for piece in _stage_pieces(state, hf_config):
        unexpected = sorted(piece.keys() - params.keys())
        if unexpected:
            raise ValueError(f"HF weights do not fit the Megatron model: unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, full in piece.items():
                whole = expert_of(name) is not None  # an expert: whole on every tensor-parallel rank
                tensor = full if whole else shard(full, split_of(name, params[name], gated), rank, size)
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: model has {tuple(params[name].shape)}, weights {tuple(tensor.shape)}")
                params[name].copy_(tensor)
        loaded |= piece.keys()
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(f"HF weights do not fit the Megatron model: missing {missing[:5]}")


def _stage_pieces(state: Mapping[str, torch.Tensor], hf_config: Any) -> Iterator[dict[str, torch.Tensor]]:
    """``state`` converted (:mod:`.convert`) in pieces — the embedding, final norm and output layer
    this stage holds (:func:`.pipeline.stage_globals`), then each of its layers — each under the names
    this rank's model has (its own experts renumbered, its stage's layers numbered from 0): a stage
    reads nothing it does not hold."""
    expert_rank, expert_size, _ = _expert_parallel()
    stage, stages, _ = _pipeline()
    layers = hf_config.num_hidden_layers
    per_stage = layers_per_stage(layers, stages)

    def local(piece: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if expert_size > 1:
            piece = local_state(piece, experts(hf_config), expert_rank, expert_size)
        return stage_state(piece, layers, stage, stages, tied(hf_config)) if stages > 1 else piece

    yield local(global_tensors(state, hf_config, stage_globals(stage, stages, tied(hf_config))))
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        yield local(layer_tensors(state, hf_config, i))


def gathered(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from this rank's pieces of ``tensors`` (named like ``model``'s parameters, e.g.
    the parameters or their gradients): an all-gather over the tensor-parallel group per split
    tensor; every tensor-parallel rank must call it."""
    import torch.distributed as dist

    _, size, group = _tensor_parallel()
    params, gated, whole = dict(model.named_parameters()), model.config.gated_linear_unit, {}
    for name, piece in tensors.items():
        split = split_of(name, params[name], gated)
        if split.dim is None or size == 1 or expert_of(name) is not None:  # experts: whole on every rank
            whole[name] = piece
            continue
        pieces = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(pieces, piece.contiguous(), group=group)
        whole[name] = unshard(pieces, split)
    return whole


def with_every_expert(tensors: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """``tensors`` (this rank's, named like the model's parameters) with every expert-parallel rank's
    experts under their global names: an all-gather over the expert-parallel group per expert
    tensor; every rank of the group must call it."""
    import torch.distributed as dist

    _, size, group = _expert_parallel()
    if size == 1:
        return tensors
    per_rank, whole = experts_per_rank(experts(hf_config), size), {}
    for name, tensor in tensors.items():
        if expert_of(name) is None:
            whole[name] = tensor
            continue
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        whole |= {global_name(name, k, per_rank): piece for k, piece in enumerate(pieces)}
    return whole


def local_hf_state(model: Any, hf_config: Any) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's pieces under HF names, no communication: a rank holds whole
    query groups (their query, key and value heads), a slice of the MLP width and of the vocabulary,
    i.e. the whole weights of the same model with 1/tp of its heads, so :func:`.convert.megatron_to_hf`
    converts them with the head counts divided (the head size kept). The pieces are the HF tensors'
    consecutive rows (q/k/v, gate/up, embedding, output layer) or columns (o_proj, down_proj) of rank
    index ``tp_rank`` — what :func:`kuberl.weights.layouts.tp_box` models. An expert-parallel rank's
    experts, numbered from 0, stack into rows ``[k·E/e, (k+1)·E/e)`` of the HF expert tensors
    (:func:`kuberl.weights.layouts.ep_box`). A pipeline stage has only its own layers (under their
    global numbers) and, first or last, the embedding or the final norm and output layer."""
    _, size, _ = _tensor_parallel()
    shape = AttentionShape.of(hf_config)
    local_config = copy.copy(hf_config)
    local_config.num_attention_heads, local_config.num_key_value_heads = shape.heads // size, shape.groups // size
    local_config.head_dim = shape.head_dim
    return megatron_to_hf(_globally_named({n: p.detach() for n, p in model.named_parameters()}, hf_config),
                          local_config)


def _globally_named(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """This pipeline stage's ``state`` under whole-model layer numbers (:func:`.pipeline.global_state`)."""
    stage, stages, _ = _pipeline()
    return global_state(state, hf_config.num_hidden_layers, stage, stages, tied(hf_config)) if stages > 1 else state


def with_every_stage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's ``state`` (whole-model names) merged, on every rank of the pipeline group."""
    import torch.distributed as dist

    _, stages, group = _pipeline()
    if stages == 1:
        return state
    pieces: list[dict[str, torch.Tensor]] = [{} for _ in range(stages)]
    dist.all_gather_object(pieces, {n: t.cpu() for n, t in state.items()}, group=group)
    return {n: t for piece in pieces for n, t in piece.items()}


def export_hf_state(model: Any, hf_config: Any) -> dict[str, torch.Tensor]:
    """The model's whole parameters under HF names (every rank must call it): what the weight sync
    sends to vLLM / torch replicas."""
    state = gathered(model, {n: p.detach() for n, p in model.named_parameters()})
    state = _globally_named(with_every_expert(state, hf_config), hf_config)
    return megatron_to_hf(with_every_stage(state), hf_config)
