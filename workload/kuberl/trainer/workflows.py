"""The episode workflow a run uses, for training and for evaluation alike (one scoring path)."""

from __future__ import annotations

from typing import Any

from ..agent.workflow import ToolWorkflow
from ..api.spec import RLExperimentSpec
from ..rewards import load_reward
from ..rollout.workflow import RLVRWorkflow
from .sft import encode


def make_workflow(spec: RLExperimentSpec, tokenizer: Any, *, group_size: int, temperature: float,
                  max_new_tokens: int, reward_function: str) -> RLVRWorkflow | ToolWorkflow:
    """Single-turn RLVR, or multi-turn tool-using episodes when ``spec.rollout.tools`` names tools."""
    rollout = spec.rollout
    common: dict[str, Any] = {
        "decode": lambda ids: tokenizer.decode(ids), "eos_id": tokenizer.eos_token_id,
        "reward": load_reward(reward_function), "group_size": group_size, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": rollout.top_p,
    }
    if not rollout.tools:
        return RLVRWorkflow(encode=lambda p: encode(tokenizer, p), **common)
    return ToolWorkflow(encode_prompt=lambda p: encode(tokenizer, p),
                        encode_text=lambda t: tokenizer(t, add_special_tokens=False).input_ids,
                        tools=[str(t) for t in rollout.tools], max_turns=rollout.max_turns, **common)
