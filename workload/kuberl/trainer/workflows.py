"""The episode workflow a run uses, for training and for evaluation alike (one scoring path)."""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..agent import sandbox
from ..agent.workflow import ToolWorkflow
from ..api.spec import RLExperimentSpec
from ..models.text import TextCodec
from ..rewards import load_reward
from ..rollout.workflow import RLVRWorkflow

log = logging.getLogger("kuberl.trainer")


def make_workflow(spec: RLExperimentSpec, tokenizer: PreTrainedTokenizerBase, *, group_size: int, temperature: float,
                  max_new_tokens: int, reward_function: str) -> RLVRWorkflow | ToolWorkflow:
    """Single-turn RLVR, or multi-turn tool-using episodes when ``spec.rollout.tools`` names tools.
    Raises ValueError (naming the field) when the python tool is asked for on a host where its sandbox
    cannot run: the run would otherwise train on nothing but the tool's refusals."""
    rollout, codec = spec.rollout, TextCodec(tokenizer)
    if "python" in [str(t) for t in rollout.tools]:
        if (reason := sandbox.available()) is not None:
            raise ValueError(f"spec.rollout.tools: python cannot run here: {reason}")
        if not sandbox.reads_confined():
            log.warning("python tool: this kernel offers no Landlock, so tool code can read what the trainer's "
                        "user can (its /proc environ holds the API token); it still has no network, processes, "
                        "signals or writes")
    common: dict[str, Any] = {
        "decode": codec.decode, "eos_id": codec.eos_id,
        "reward": load_reward(reward_function), "group_size": group_size, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": rollout.top_p,
    }
    if not rollout.tools:
        return RLVRWorkflow(encode=codec.encode_prompt, **common)
    return ToolWorkflow(encode_prompt=codec.encode_prompt, encode_text=codec.encode_text,
                        tools=[str(t) for t in rollout.tools], max_turns=rollout.max_turns, **common)
