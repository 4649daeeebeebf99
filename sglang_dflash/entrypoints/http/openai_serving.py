"""OpenAIServing: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from sglang_dflash.entrypoints.http import openai_adapter as adapter
from sglang_dflash.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from sglang_dflash.entrypoints.http.streaming import stream_outputs
from sglang_dflash.entrypoints.http.tokenizer_manager import AsyncTokenizerManager
from sglang_dflash.scheduler.schedule_batch import Req


class OpenAIServing:
    def __init__(self, tokenizer_manager: AsyncTokenizerManager, model_name: str, cache_report: bool = False):
        self.tm = tokenizer_manager
        self.model = model_name
        self.cache_report = cache_report  # usage.prompt_tokens_details.cached_tokens (--enable-cache-report)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        req = await self.tm.run(self.chat_req, body)
        return await self.serve(req, body, request, adapter.ChatFormat(req.rid, self.model, self.cache_report))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        req = await self.tm.run(self.completion_req, body)
        return await self.serve(req, body, request, adapter.CompletionFormat(req.rid, self.model, self.cache_report))

    # ---- request building, on the tokenizer thread ----
    def chat_req(self, body: ChatCompletionRequest) -> Req:
        adapter.check_supported(body)
        ids = self.tm.chat_ids(adapter.chat_messages(body))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self.make_req(body, ids, max_tokens)

    def completion_req(self, body: CompletionRequest) -> Req:
        adapter.check_supported(body)
        return self.make_req(body, adapter.completion_input_ids(body, self.tm.encode), body.max_tokens)

    def make_req(self, body: OpenAIRequest, ids: list[int], max_tokens: int | None) -> Req:
        params = adapter.sampling_params(body, max_tokens, len(ids), self.tm.context_length)
        req = self.tm.make_req(input_ids=ids, sampling_params=params)
        if max_tokens is None:
            self.tm.fit_kv_pool(req)
        return req

    async def serve(
        self, req: Req, body: OpenAIRequest, request: Request, fmt: adapter.ChatFormat | adapter.CompletionFormat
    ) -> Response:
        if not body.stream:
            text, _, last = await self.tm.generate_all(req, request)
            return JSONResponse(fmt.response(text, last).model_dump(exclude_none=True))
        outputs = self.tm.generate(req, request)
        first = await anext(outputs)  # a refused request is a 400 here, before any byte of the stream
        usage = body.stream_options is not None and body.stream_options.include_usage

        def render(out):
            return [fmt.chunk(out), fmt.usage_chunk(out)] if out.finished and usage else [fmt.chunk(out)]

        return stream_outputs(first, outputs, render, fmt.opening())
