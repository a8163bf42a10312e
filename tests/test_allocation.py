from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuberl.api import AllocationError, Dims, parse_allocation
from kuberl.api.spec import ALLOCATION_PATTERN


def test_areal_moe_form():
    alloc = parse_allocation("vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)")
    assert alloc.inference.engine == "vllm"
    assert alloc.inference.dims == Dims(data=4, tensor=4)
    assert alloc.trainer.backend == "megatron"
    assert alloc.trainer.attn == Dims(data=2, pipeline=4, tensor=4)
    assert alloc.trainer.ffn == Dims(data=1, pipeline=4, expert=8)
    assert alloc.trainer.devices == 32


def test_trainer_backend_defaults_to_fsdp():
    alloc = parse_allocation("torch:d1+d2")
    assert alloc.trainer.backend == "fsdp"
    assert alloc.trainer.attn.data == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("vllm:d4t4", "'<inference>+<trainer>'"),
        ("sglang:d4+fsdp:d4", "ENGINE one of vllm, torch"),
        ("vllm:d4x2+fsdp:d4", "degree 'x' is not allowed; use d, p, t"),
        ("vllm:d4t+fsdp:d4", "not a list of degrees"),
        ("vllm:d4d2+fsdp:d4", "given twice"),
        ("vllm:d0+fsdp:d4", "between 1 and 65536"),
        ("vllm:d4e2+fsdp:d4", "degree 'e' is not allowed"),
        ("vllm:d4+fsdp:d4t2", "degree 't' is not allowed"),
        ("vllm:d4+megatron:(attn:d2p4t4|ffn:d1p2e8)", "same pipeline degree"),
        ("vllm:d4+megatron:(attn:d2p4t4|ffn:d1p4e4)", "must be equal"),
        ("vllm:d4+megatron:(attn:d2p4t4)", "MoE form"),
        ("vllm:d4+deepspeed:d4", "BACKEND one of fsdp, megatron"),
    ],
)
def test_malformed_strings_say_what_is_allowed(text, fragment):
    with pytest.raises(AllocationError) as err:
        parse_allocation(text)
    assert fragment in str(err.value)


degree = st.integers(min_value=1, max_value=64)


@given(d=degree, t=degree, p=degree, td=degree)
def test_roundtrip_of_generated_strings(d, t, p, td):
    alloc = parse_allocation(f"vllm:d{d}t{t}p{p}+fsdp:d{td}")
    assert alloc.inference.devices == d * t * p
    assert alloc.trainer.devices == td


@pytest.mark.parametrize(
    "text",
    ["vllm:d4t4+megatron:(attn:d2p4t4|ffn:d1p4e8)", "torch:d1+d2", "vllm:d2t1+fsdp:d8", "vllm:d1+megatron:d2p2t2"],
)
def test_crd_pattern_accepts_what_the_parser_accepts(text):
    parse_allocation(text)
    assert re.match(ALLOCATION_PATTERN, text)


@pytest.mark.parametrize("text", ["vllm:d4t4", "sglang:d1+d1", "vllm:d1+megatron:(attn:d2)", "vllm:d1+fsdp:"])
def test_crd_pattern_rejects_garbage(text):
    assert not re.match(ALLOCATION_PATTERN, text)
