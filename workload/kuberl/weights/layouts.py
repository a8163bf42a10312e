"""Who holds and who needs which slice of every parameter: trainer and inference layouts (pure).

Trainer side (:func:`fsdp2_holdings`, :func:`megatron_holdings`) returns :class:`Holding` s;
inference side (:func:`inference_needs`) returns :class:`Need` s, optionally in vLLM's fused
layout (``qkv_proj`` = [q; k; v] shards, ``gate_up_proj`` = [gate; up] shards). Parameter names
are Hugging Face names (``model.layers.3.self_attn.q_proj.weight``); tensor-parallel rules:

- column-parallel (dim 0): q/k/v/gate/up projections (and their biases), embeddings, lm_head;
- row-parallel (dim 1): o_proj, down_proj;
- everything else (norms, MoE routers) is replicated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..api.allocation import InferenceAllocation, TrainerAllocation
from .plan import Box, Holding, Need, full_box

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ParamMeta:
    name: str
    shape: tuple[int, ...]
    itemsize: int  # bytes per element

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def chunk_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows of chunk ``i`` of ``n`` split ``torch.chunk``-style (what FSDP2 shards on dim 0)."""
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


def _module(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` → ``q_proj``."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def tp_split_dim(meta: ParamMeta) -> int | None:
    module = _module(meta.name)
    if module in COLUMN:
        return 0
    if module in ROW and len(meta.shape) == 2:
        return 1
    return None


def tp_box(meta: ParamMeta, tp: int, t: int) -> Box:
    """The slice tensor-parallel rank ``t`` of ``tp`` holds."""
    box = list(full_box(meta.shape))
    dim = tp_split_dim(meta) if tp > 1 else None
    if dim is not None:
        box[dim] = chunk_range(meta.shape[dim], tp, t)
    return tuple(box)


def is_stacked_expert(name: str) -> bool:
    """transformers' stacked expert tensors, ``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I]: expert j in row j."""
    return name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def ep_box(meta: ParamMeta, ep: int, k: int) -> Box:
    """The slice expert-parallel rank ``k`` of ``ep`` holds of a stacked expert tensor: its experts'
    rows ``[k·E/ep, (k+1)·E/ep)`` (:mod:`kuberl.megatron.expert_parallel`)."""
    box = list(full_box(meta.shape))
    box[0] = chunk_range(meta.shape[0], ep, k)
    return tuple(box)


# ---- trainer layouts -----------------------------------------------------------------------


def fsdp2_holdings(params: list[ParamMeta], ranks: list[int], replicate: int = 1) -> list[Holding]:
    """FSDP2 (``replicate`` = 1) or HSDP: dim-0 shards over each group of len(ranks)/replicate ranks."""
    if len(ranks) % replicate:
        raise ValueError(f"{len(ranks)} trainer ranks cannot form {replicate} equal replica groups")
    shard = len(ranks) // replicate
    out = []
    for meta in params:
        for i, rank in enumerate(ranks):
            lo, hi = chunk_range(meta.shape[0], shard, i % shard)
            out.append(Holding(rank, meta.name, ((lo, hi), *full_box(meta.shape)[1:])))
    return out


def hf_stage(name: str, layers: int, stages: int) -> int:
    """The pipeline stage that holds HF parameter ``name`` — the one rule for the trainer's holdings
    (``kuberl.megatron``) and the planner's: layer i of n on stage ⌊i·p / n⌋ (i ÷ (n/p) when p divides n,
    which the trainer requires); the embedding on the first stage; the final norm and a separate
    ``lm_head`` on the last."""
    match = _LAYER.search(name)
    if match:
        return int(match.group(1)) * stages // layers
    return 0 if name.startswith("model.embed_tokens") else stages - 1


def megatron_holdings(
    params: list[ParamMeta], ranks: list[int], trainer: TrainerAllocation, layers: int, experts: int = 0
) -> list[Holding]:
    """Holdings of a Megatron-core trainer laid out as its allocation says (``megatron:d2p4t4`` or
    the MoE form ``megatron:(attn:d2p4t4|ffn:d1p4e8)``); no distributed optimizer, so data-parallel
    replicas hold copies. Rank order, tensor-parallel fastest: dense rank = (stage·d + i)·t + j with
    the attn degrees; expert rank = ((stage·d' + i)·e + k)·t' + j with the ffn degrees (d', e, t').
    """
    attn, ffn = trainer.attn, trainer.ffn or trainer.attn
    if attn.context != 1 or attn.expert != 1:
        raise ValueError(f"the planner models attn degrees d, t, p only; got {attn}")
    if ffn.pipeline != attn.pipeline or ffn.context != 1 or ffn.world_size != attn.world_size:
        raise ValueError(f"ffn degrees {ffn} must cover the same {attn.world_size} ranks and stages as attn {attn}")
    if len(ranks) != attn.world_size:
        raise ValueError(f"the allocation covers {attn.world_size} trainer ranks but there are {len(ranks)}")
    tp, pp, dp = attn.tensor, attn.pipeline, attn.data
    out = []
    for meta in params:
        stage = hf_stage(meta.name, layers, pp)
        expert = _EXPERT.search(meta.name)
        if expert:
            e_rank = int(expert.group(1)) * ffn.expert // experts
            for d in range(ffn.data):
                for t in range(ffn.tensor):
                    rank = ((stage * ffn.data + d) * ffn.expert + e_rank) * ffn.tensor + t
                    out.append(Holding(ranks[rank], meta.name, tp_box(meta, ffn.tensor, t)))
            continue
        for d in range(dp):
            for t in range(tp):
                out.append(Holding(ranks[(stage * dp + d) * tp + t], meta.name, tp_box(meta, tp, t)))
    return out


def inference_ranks(inference: InferenceAllocation, first: int) -> list[list[int]]:
    """The ranks of each replica (``d`` replicas × ``t`` tensor-parallel ranks), numbered from ``first``."""
    dims = inference.dims
    if dims.pipeline != 1:
        raise ValueError(f"the planner models tensor-parallel replicas only; got pipeline={dims.pipeline}")
    return [[first + r * dims.tensor + t for t in range(dims.tensor)] for r in range(dims.data)]


# ---- inference layouts ---------------------------------------------------------------------


def inference_needs(params: list[ParamMeta], replicas: list[list[int]], fuse: bool = False) -> list[Need]:
    """What each inference rank needs: replicas × tensor-parallel ranks (``replicas[i][t]``)."""
    by_name = {p.name: p for p in params}
    out = []
    for ranks in replicas:
        tp = len(ranks)
        for t, rank in enumerate(ranks):
            for meta in params:
                box = tp_box(meta, tp, t)
                dest, dest_box = meta.name, tuple((0, hi - lo) for lo, hi in box)
                module = _module(meta.name)
                if fuse and module in FUSED:
                    fused, members = FUSED[module]
                    dest = meta.name.replace(f".{module}.", f".{fused}.")
                    offset = 0
                    for member in members[: members.index(module)]:
                        sibling = by_name[meta.name.replace(f".{module}.", f".{member}.")]
                        lo, hi = tp_box(sibling, tp, t)[0]
                        offset += hi - lo
                    dest_box = ((offset, offset + box[0][1] - box[0][0]), *dest_box[1:])
                out.append(Need(rank, dest, dest_box, meta.name, box))
    return out


def dest_shapes(needs: list[Need], rank: int) -> dict[str, tuple[int, ...]]:
    """The local tensor shapes rank ``rank`` receives into (fused tensors included)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for n in needs:
        if n.rank == rank:
            old = shapes.get(n.dest, (0,) * len(n.dest_box))
            shapes[n.dest] = tuple(max(o, hi) for o, (_, hi) in zip(old, n.dest_box, strict=True))
    return shapes


# ---- model catalogs for cluster-scale planning ---------------------------------------------


@dataclass(frozen=True)
class MoEShape:
    """A Qwen3-MoE-style decoder (the shapes only)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    moe_intermediate: int
    vocab: int
    itemsize: int = 2  # bf16

    def params(self) -> list[ParamMeta]:
        h, d, out = self.hidden, self.head_dim, []

        def add(name: str, *shape: int) -> None:
            out.append(ParamMeta(name, tuple(shape), self.itemsize))

        add("model.embed_tokens.weight", self.vocab, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            add(p + "input_layernorm.weight", h)
            add(p + "self_attn.q_proj.weight", self.heads * d, h)
            add(p + "self_attn.k_proj.weight", self.kv_heads * d, h)
            add(p + "self_attn.v_proj.weight", self.kv_heads * d, h)
            add(p + "self_attn.o_proj.weight", h, self.heads * d)
            add(p + "self_attn.q_norm.weight", d)
            add(p + "self_attn.k_norm.weight", d)
            add(p + "post_attention_layernorm.weight", h)
            add(p + "mlp.gate.weight", self.experts, h)
            for e in range(self.experts):
                add(p + f"mlp.experts.{e}.gate_proj.weight", self.moe_intermediate, h)
                add(p + f"mlp.experts.{e}.up_proj.weight", self.moe_intermediate, h)
                add(p + f"mlp.experts.{e}.down_proj.weight", h, self.moe_intermediate)
        add("model.norm.weight", h)
        add("lm_head.weight", self.vocab, h)
        return out


QWEN3_30B_A3B = MoEShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                         moe_intermediate=768, vocab=151936)  # fmt: skip
QWEN3_235B_A22B = MoEShape(hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, experts=128,
                           moe_intermediate=1536, vocab=151936)  # fmt: skip
