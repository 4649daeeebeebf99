"""OpenAI-compatible request/response models and SGLang's native /generate input (pydantic). Request models
are strict: a boolean must be a boolean, an integer an integer (no "1", 1.0 or true); ranges and finiteness
are checked once, by SamplingParams, for every endpoint and the offline Engine alike."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(strict=True, extra="allow")


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions. Unknown fields are ignored, like vLLM."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    # fields this server refuses with a clear 400 when set to anything but their defaults
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("logprobs", "logit_bias")


class ContentPart(BaseModel):
    model_config = STRICT

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("logprobs", "logit_bias", "tools", "response_format")


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI default for legacy completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("logprobs", "logit_bias", "echo", "suffix", "best_of")


class GenerateReqInput(BaseModel):
    """SGLang's native /generate: a text (or a list of texts) or input_ids, with sampling_params (checked
    by SamplingParams: any JSON value there gets a 400 naming the field, not a 500)."""

    model_config = ConfigDict(strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None  # a list for a batch, one per prompt


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the radix cache served (not computed)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatMessageOut(BaseModel):
    role: str | None = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatDeltaChoice(BaseModel):
    index: int = 0
    delta: ChatMessageOut
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatDeltaChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang-dflash"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]

