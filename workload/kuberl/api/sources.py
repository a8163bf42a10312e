"""What a run is made of besides the model: its prompts (``DatasetSource``), how they are rendered
(``ChatTemplateSpec``), how completions are scored (``RewardSpec``) and what leaves the run
(``ExportSpec``). Part of the RLExperiment spec (:mod:`.spec`), split out to keep both readable."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from .base import ApiModel
from .rewards import CODE_REWARD, CODE_WALL_SECONDS, IMPORT_PATH_PATTERN

HUB_REVISION_PATTERN = r"[\w-]+([./][\w-]+)*"  # a hub branch, tag or commit: no "..", no "." segment


class ChatTemplateMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


TemplateArgument = Annotated[str, Field(max_length=1024)] | bool | int | float


class ChatTemplateSpec(ApiModel):
    """How single-turn prompts become tokens: through the tokenizer's chat template (as the model was
    tuned to read them) or as raw text after BOS. The rollout, the evaluation, the SFT warm-up and the
    inference engines all get the same token ids (``kuberl.models.text``)."""

    mode: ChatTemplateMode = Field(
        ChatTemplateMode.AUTO,
        description="auto: the template when the tokenizer has one (or `template` is given); on: required; "
                    "off: raw text after BOS (chat-list prompts are then refused)")
    template: str | None = Field(None, max_length=65536,
                                 description="a Jinja chat template that replaces the tokenizer's own")
    system_prompt: str | None = Field(None, max_length=65536,
                                      description="a system message put before every prompt that has none")
    kwargs: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=64)], TemplateArgument] = Field(
        default_factory=dict, max_length=32,
        description="extra variables of the template, e.g. {enable_thinking: false} for Qwen3")


DATASET_PATH_PATTERN = r"^(builtin:[a-z0-9-]+|file://.+|s3://.+|hf://datasets/[A-Za-z0-9][\w.-]*/[\w.-]+|/.+)$"
ColumnPath = Annotated[str, Field(pattern=r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*$", max_length=256)]


class DatasetSource(ApiModel):
    """Prompts and answers: generated (builtin:NAME) or a table read with the ``datasets`` library."""

    path: str = Field(
        min_length=1, max_length=1024, pattern=DATASET_PATH_PATTERN,
        description="builtin:NAME; a .jsonl, .json or .parquet file (file:///path on a claim, s3://bucket/key); or "
                    "hf://datasets/ORG/NAME (the Hugging Face hub: config and split below)")
    prompt_key: ColumnPath = Field("prompt", description="the prompt's column: text, or a chat list of "
                                                         "{role, content} messages; dotted for nested fields")
    answer_key: ColumnPath = Field("answer",
                                   description="the reference answer's column, e.g. reward_model.ground_truth")
    config: str | None = Field(None, max_length=256, description="hf:// datasets: the configuration (subset)")
    split: str = Field("train", pattern=r"^[\w.\[\]:%-]+$", max_length=256,
                       description="the split (hf:// datasets; files are one split, 'train')")
    revision: str | None = Field(None, pattern=rf"^{HUB_REVISION_PATTERN}$", max_length=256,
                                 description="hf:// datasets: a branch, tag or commit")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="rows whose rendered prompt is longer are skipped (and counted: "
                                "summary dataset.rowsTooLong)")


class RewardSpec(ApiModel):
    """How an episode is scored: a Python function, run in reward worker processes."""

    function: str = Field(
        pattern=IMPORT_PATH_PATTERN,
        description="import path of the reward function, 'package.module:function': "
                    "fn(prompt, completion, answer, **row) -> float, plain or async; KubeRL's: "
                    "kuberl.rewards:math (math-verify), exact_match, digit_match",
    )
    workers: int = Field(4, ge=1, le=256, description="reward worker processes of trainer rank 0")
    timeout_seconds: float = Field(30.0, gt=0, le=3600, description="a call past this scores 0 (counted: "
                                                                      "rewardTimeouts) and its worker is replaced")

    @model_validator(mode="after")
    def _sandbox_ends_first(self) -> RewardSpec:
        if self.function == CODE_REWARD and self.timeout_seconds <= CODE_WALL_SECONDS:
            raise ValueError(f"timeoutSeconds {self.timeout_seconds:g}: {CODE_REWARD} stops its sandboxes after "
                             f"{CODE_WALL_SECONDS:g} s; give the call longer than that (e.g. 30)")
        return self


class ExportDtype(StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class ExportSpec(ApiModel):
    """Hugging Face model directories of the policy (``from_pretrained``-ready: config, sharded
    safetensors with their index, tokenizer with its chat template, generation config), written beside
    the checkpoints under ``hf/step-NNNNNNNN/``, manifest last, as checkpoints are."""

    final: bool = Field(True, description="export the policy after the last step (wherever checkpoints go: "
                                          "spec.checkpoint.uri, or kuberl run's work dir)")
    every_checkpoints: int = Field(0, ge=0, description="also export at every N-th checkpoint (0: only the final)")
    dtype: ExportDtype = Field(ExportDtype.BFLOAT16, description="the weights' dtype in the files")
