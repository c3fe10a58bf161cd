"""Request schemas of the HTTP API (pydantic, strict): every accepted field is honoured, others are a 400.

Strict mode means no silent coercion ("1" is not a number, 1 is not a boolean) and `extra="forbid"`
means a parameter sglx does not implement (logit_bias, tools, user, ...) is named in an error instead
of being ignored. Ranges follow OpenAI's API where it defines one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16  # choices per request: each is a full generation, so a cap keeps one request from flooding the engine
MAX_LOGPROBS = 20
MAX_STOP = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def check_stop(value: Any) -> tuple[str, ...]:
    """stop: a string or a list of (at most MAX_STOP) non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings (got {len(items)})")
    if any(not s for s in items):
        raise ValueError("stop strings must not be empty")
    return tuple(items)


class StreamOptions(Strict):
    include_usage: bool | None = None


class SamplingFields(Strict):
    """Sampling knobs shared by /v1/completions and /v1/chat/completions (null = the default)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM/SGLang): -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)  # extension
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # extension (HF style)
    stop: Any = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)  # extension
    ignore_eos: bool | None = None  # extension
    skip_special_tokens: bool | None = None  # extension
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: text, a list of texts, token ids, or a list of token-id lists."""

    prompt: Any
    max_tokens: int | None = Field(None, ge=1)  # null: 16, as OpenAI
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # log-probs of the sampled token + this many top

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and (
                all(isinstance(p, str) for p in value) or ids(value) or all(ids(p) for p in value)):
            return value
        raise ValueError("must be a string, a non-empty list of strings, a non-empty list of token ids, "
                         "or a list of non-empty token-id lists")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Any  # text, or a list of {"type": "text", "text": ...} parts (joined with newlines)

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2
                for p in value):
            return "\n".join(p["text"] for p in value)
        raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts (only text is '
                         "supported)")

    def text(self) -> str:
        return str(self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # null: up to the context length
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


class NativeSamplingParams(Strict):
    """`sampling_params` of POST /generate: sglx.SamplingParams' fields, as in SGLang's native API."""

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stop: Any = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value


class GenerateRequest(Strict):
    """POST /generate (SGLang-style): text or input_ids (one, or a batch), sampling_params, stream."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        batch = isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))
        if (self.text == [] or self.input_ids == []) or (
                isinstance(self.input_ids, list) and batch and any(not x for x in self.input_ids)):
            raise ValueError("the prompt is empty")
        if batch and self.stream:
            raise ValueError("stream takes one prompt, not a batch")
        return self

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))
