"""The Tinker API's JSON requests this server acts on, as the ``tinker`` SDK sends them.

Fields a newer SDK adds are ignored (the wire protocol grows); a field this server knows but does
not serve is refused when it asks for something (top-k sampling, per-request seeds, top-k or target
prompt log-probs, in-flight sampling clients, another optimizer than AdamW), with a message that names
it — never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ClientError
from .sampler import SampleParams
from .states import NAME_PATTERN, Keeping
from .trainee import AdapterShape


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def _refuse(field: str, value: Any, default: Any) -> None:
    if value != default:
        raise ValueError(f"{field}={value!r} is not served here (leave it at {default!r})")


class LoraConfig(_Request):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    def shape(self) -> AdapterShape:
        return AdapterShape(self.rank, self.train_attn, self.train_mlp, self.train_unembed, self.seed)


TTL_SECONDS = Field(None, ge=3600, le=10 * 365 * 86400)  # the SDK's documented range: an hour to ten years


class _Kept(_Request):
    """A save's ``ttl_seconds`` and ``user_metadata``: how what it saves is kept."""

    ttl_seconds: int | None = TTL_SECONDS
    user_metadata: dict[str, str] | None = None

    @property
    def keeping(self) -> Keeping:
        return Keeping.from_ttl(self.ttl_seconds, self.user_metadata)


class CreateModel(_Request):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    user_metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _adam_only(self) -> CreateModel:
        _refuse("optimizer_config.type", self.optimizer_config.get("type", "adamw"), "adamw")
        _refuse("user_metadata", self.user_metadata, None)  # a training run's metadata: not kept here yet
        return self


class AdamParams(_Request):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = 0.0

    def step_args(self) -> dict[str, float]:
        return {"lr": self.learning_rate, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "grad_clip_norm": self.grad_clip_norm}


class OptimStep(_Request):
    model_id: str
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _adam_only(self) -> OptimStep:
        if self.optimizer_params is not None:
            _refuse("optimizer_params.type", self.optimizer_params.get("type"), "adamw")
        if self.adam_params is None:
            raise ValueError("adam_params: missing")
        return self


class SaveForSampler(_Kept):
    model_id: str
    path: str | None = Field(None, pattern=rf"^{NAME_PATTERN}$")
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"

    @model_validator(mode="after")
    def _snapshots_only(self) -> SaveForSampler:
        _refuse("kind", self.kind, "snapshot")
        if self.path is None:  # served at once by its own sampler, kept while that lives
            _refuse("ttl_seconds", self.ttl_seconds, None)
            _refuse("user_metadata", self.user_metadata, None)
        return self


class SaveState(_Kept):
    model_id: str
    path: str
    overwrite: bool = False


class WeightsInfo(_Request):
    tinker_path: str


class SetTtl(_Request):
    ttl_seconds: int | None = TTL_SECONDS


class LoadState(_Request):
    """Into a model (``model_id``), or a new one (``session_id`` + ``model_seq_id``: the SDK's create-from-state)."""

    path: str
    optimizer: bool
    model_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None  # creating from a state: the base the client expects it to be on
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _addressed(self) -> LoadState:
        _refuse("weights_access_token", self.weights_access_token, None)
        _refuse("user_metadata", self.user_metadata, None)
        _refuse("optimizer_config.type", (self.optimizer_config or {}).get("type", "adamw"), "adamw")
        if (self.model_id is None) == (self.session_id is None or self.model_seq_id is None):
            raise ValueError("give model_id, or session_id with model_seq_id")
        return self


class CreateSamplingSession(_Request):
    session_id: str
    base_model: str | None = None
    model_path: str | None = None


class Chunk(_Request):
    type: Literal["encoded_text"]
    tokens: list[int]


class ModelInput(_Request):
    chunks: list[Chunk]

    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]


class SamplingParams(_Request):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _served(self) -> SamplingParams:
        _refuse("sampling_params.top_k", self.top_k, -1)
        _refuse("sampling_params.seed", self.seed, None)
        return self

    def checked(self) -> SampleParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SampleParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                            stop_tokens=tuple(s for s in stop if isinstance(s, int)),
                            stop_strings=tuple(s for s in stop if isinstance(s, str)))


class Sample(_Request):
    sampling_session_id: str
    num_samples: int = Field(1, ge=1, le=256)
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None

    @model_validator(mode="after")
    def _served(self) -> Sample:
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            _refuse(name, getattr(self, name), 0)
        for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            _refuse(name, getattr(self, name), None)
        _refuse("record_stability_info", bool(self.record_stability_info), False)
        return self


class FutureRetrieve(_Request):
    request_id: str


Parsed = TypeVar("Parsed", bound=BaseModel)


def parse(model: type[Parsed], body: Any) -> Parsed:
    """``body`` as ``model``; ClientError naming each bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in err.errors())
        raise ClientError(problems) from err
