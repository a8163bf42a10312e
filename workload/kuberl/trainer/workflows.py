"""The episode workflow a run uses, for training and for evaluation alike (one scoring path)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from .. import sandbox
from ..agent.workflow import ToolWorkflow
from ..api.rollout import ToolName
from ..api.spec import RLExperimentSpec
from ..data.datasets import DropCount, Example
from ..imports import imported
from ..models.text import TextCodec
from ..rewards.pool import Scorer, make_scorer
from ..rollout.workflow import RLVRWorkflow, RolloutWorkflow, WorkflowContext

log = logging.getLogger("kuberl.trainer")


WORKFLOW_FIELD = "spec.rollout.workflow"


def make_workflow(spec: RLExperimentSpec, tokenizer: PreTrainedTokenizerBase, *, group_size: int, temperature: float,
                  max_new_tokens: int, reward: Scorer) -> RolloutWorkflow:
    """The user's workflow (``spec.rollout.workflow``: built from a :class:`WorkflowContext`), else
    single-turn RLVR, or multi-turn tool-using episodes when ``spec.rollout.tools`` names tools;
    prompts rendered as ``spec.model.chatTemplate`` says. Raises ValueError (naming the field) when the
    python tool is asked for on a host where its sandbox cannot run (the run would otherwise train on
    nothing but the tool's refusals), or the workflow cannot be imported or built."""
    rollout, codec = spec.rollout, TextCodec(tokenizer, spec.model.chat_template)
    if ToolName.PYTHON in rollout.tools:
        if (reason := sandbox.available()) is not None:
            raise ValueError(f"spec.rollout.tools: python cannot run here: {reason}")
        if not sandbox.reads_confined():
            log.warning("python tool: this kernel offers no Landlock, so tool code can read what the trainer's "
                        "user can (its /proc environ holds the API token); it still has no network, processes, "
                        "signals or writes")
    context = WorkflowContext(
        encode_prompt=codec.encode_prompt, prompt_text=codec.prompt_text, encode_text=codec.encode_text,
        decode=codec.decode, eos_id=codec.eos_id, reward=reward, group_size=group_size,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=rollout.top_p, tools=tuple(rollout.tools),
        max_turns=rollout.max_turns)
    if rollout.workflow is not None:
        return user_workflow(rollout.workflow, context)
    if rollout.tools:
        return ToolWorkflow(context)
    return RLVRWorkflow(context)


def user_workflow(path: str, context: WorkflowContext) -> RolloutWorkflow:
    """``path``'s object called with ``context``; ValueError naming the field when it cannot be imported,
    fails to build, or what it builds has no ``async def run_episode``."""
    factory = imported(path, WORKFLOW_FIELD)
    if not callable(factory):
        raise ValueError(f"{WORKFLOW_FIELD} {path!r}: not a class or function (it is {type(factory).__name__})")
    try:
        workflow = factory(context)
    except Exception as err:
        raise ValueError(f"{WORKFLOW_FIELD} {path!r}: building it from a WorkflowContext failed: {err!r}") from err
    if not inspect.iscoroutinefunction(getattr(workflow, "run_episode", None)):
        raise ValueError(f"{WORKFLOW_FIELD} {path!r}: what it returns has no async run_episode(client, example, "
                         "group_id) (kuberl.rollout.workflow.RolloutWorkflow)")
    return workflow


def make_reward(spec: RLExperimentSpec, function: str | None = None, field: str = "spec.reward.function") -> Scorer:
    """The scorer of ``function`` (default ``spec.reward.function``) with ``spec.reward``'s pool size and
    time limit; raises ValueError naming ``field`` when the function cannot be imported, or is the
    ``code`` reward on a host where the sandbox cannot run (every completion would score 0)."""
    function = function or spec.reward.function
    if function == "kuberl.rewards:code" and (reason := sandbox.available()) is not None:
        raise ValueError(f"{field}: kuberl.rewards:code cannot run here: {reason}")
    return make_scorer(function, spec.reward.workers, spec.reward.timeout_seconds, field)


@dataclass
class PromptCheck:
    """What the run does to the dataset's prompts before the policy sees them: rendered as
    ``spec.model.chatTemplate`` says, rows longer than ``spec.dataset.maxPromptTokens`` skipped
    (counted in ``dropped``); the summary shows the first rendered prompt."""

    codec: TextCodec
    max_tokens: int | None
    dropped: DropCount = field(default_factory=DropCount)
    first_prompt: str | None = None

    @classmethod
    def of(cls, spec: RLExperimentSpec, tokenizer: PreTrainedTokenizerBase) -> PromptCheck:
        return cls(TextCodec(tokenizer, spec.model.chat_template), spec.dataset.max_prompt_tokens)

    def keep(self, example: Example) -> bool:
        return self.max_tokens is None or len(self.codec.encode_prompt(example.prompt)) <= self.max_tokens

    def rendered(self, example: Example) -> str:
        """``example``'s prompt as the policy reads it; ValueError (naming the field) if it cannot be."""
        text = self.codec.prompt_text(example.prompt)
        log.info("prompts %s; the first: %r", "through the chat template" if self.codec.uses_chat_template
                 else "as raw text after BOS", text[:500])
        return text

    def summary(self) -> dict[str, Any]:
        return {"chat_template": self.codec.uses_chat_template, "first_prompt": self.first_prompt,
                "max_prompt_tokens": self.max_tokens, "rows_too_long": len(self.dropped)}
