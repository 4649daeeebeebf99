"""OpenAI chat/completions requests -> token ids + SGLang sampling params, and outputs -> OpenAI responses."""

from __future__ import annotations

from collections.abc import Callable

from sglang_dflash.entrypoints.http.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaChoice,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    OpenAIRequest,
    PromptTokensDetails,
    UsageInfo,
)
from sglang_dflash.entrypoints.http.scheduler_thread import ReqOutput

SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
)


def check_supported(body: OpenAIRequest) -> None:
    if body.n != 1:
        raise ValueError(f"n={body.n} is not supported: this server returns exactly one choice (n=1)")
    if getattr(body, "best_of", None) not in (None, 1):
        raise ValueError("best_of is not supported (only best_of=1)")
    for name in body.UNSUPPORTED:
        value = getattr(body, name)
        if not (value is None or value is False or value in ([], {}) or value == {"type": "text"}):
            raise ValueError(f"'{name}' is not supported by this server")


def sampling_params(body: OpenAIRequest, max_tokens: int | None, prompt_len: int, context_length: int) -> dict:
    """SGLang sampling params; no max_tokens means up to the end of the context (as in vLLM/SGLang)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    params = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    params["max_new_tokens"] = max_tokens if max_tokens is not None else max(1, context_length - prompt_len)
    return params


def message_text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" for part in content):
        raise ValueError("only text content parts are supported")
    return "".join(part.text or "" for part in content)


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    if not body.messages:
        raise ValueError("messages must be a non-empty list")
    return [{"role": m.role, "content": message_text(m.content)} for m in body.messages]


def completion_input_ids(body: CompletionRequest, encode: Callable[[str], list[int]]) -> list[int]:
    """Ids of the one prompt of a request: a string, ids, or a list of one of those."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    return encode(prompt) if isinstance(prompt, str) else prompt


def finish_reason(reason: dict | None) -> str | None:
    if reason is None:
        return None
    return reason["type"] if reason["type"] in ("stop", "length") else "abort"


def usage(meta_info: dict, cache_report: bool = False) -> UsageInfo:
    """Token counts; with --enable-cache-report (as in SGLang) prompt_tokens_details.cached_tokens too."""
    p, c = meta_info["prompt_tokens"], meta_info["completion_tokens"]
    details = PromptTokensDetails(cached_tokens=meta_info["cached_tokens"]) if cache_report else None
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=details)


def matched_stop(reason: dict | None) -> int | str | None:
    return None if reason is None else reason.get("matched")


class ChatFormat:
    """chat.completion responses and chat.completion.chunk stream events of one request."""

    def __init__(self, rid: str, model: str, cache_report: bool = False):
        self.id, self.model, self.cache_report = f"chatcmpl-{rid}", model, cache_report

    def response(self, text: str, last: ReqOutput) -> ChatCompletionResponse:
        reason = last.finished_reason
        choice = ChatCompletionChoice(
            message=ChatMessageOut(content=text), finish_reason=finish_reason(reason), matched_stop=matched_stop(reason)
        )
        return ChatCompletionResponse(id=self.id, model=self.model, choices=[choice],
                                      usage=usage(last.meta_info, self.cache_report))

    def opening(self) -> list[ChatCompletionChunk]:
        delta = ChatDeltaChoice(delta=ChatMessageOut(role="assistant", content=""))
        return [ChatCompletionChunk(id=self.id, model=self.model, choices=[delta])]

    def chunk(self, out: ReqOutput) -> ChatCompletionChunk:
        reason = out.finished_reason
        delta = ChatDeltaChoice(
            delta=ChatMessageOut(role=None, content=out.text), finish_reason=finish_reason(reason),
            matched_stop=matched_stop(reason),
        )
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[delta])

    def usage_chunk(self, last: ReqOutput) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[],
                                   usage=usage(last.meta_info, self.cache_report))


class CompletionFormat:
    """text_completion responses and stream events of one request."""

    def __init__(self, rid: str, model: str, cache_report: bool = False):
        self.id, self.model, self.cache_report = f"cmpl-{rid}", model, cache_report

    def response(self, text: str, last: ReqOutput) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, model=self.model, choices=[self.choice(text, last)],
            usage=usage(last.meta_info, self.cache_report),
        )

    def opening(self) -> list[CompletionResponse]:
        return []

    def chunk(self, out: ReqOutput) -> CompletionResponse:
        return CompletionResponse(id=self.id, model=self.model, choices=[self.choice(out.text, out)])

    def usage_chunk(self, last: ReqOutput) -> CompletionResponse:
        return CompletionResponse(id=self.id, model=self.model, choices=[],
                                  usage=usage(last.meta_info, self.cache_report))

    @staticmethod
    def choice(text: str, out: ReqOutput) -> CompletionChoice:
        reason = out.finished_reason
        return CompletionChoice(text=text, finish_reason=finish_reason(reason), matched_stop=matched_stop(reason))
