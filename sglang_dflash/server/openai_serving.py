"""OpenAIServing: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.server import openai_adapter as adapter
from sglang_dflash.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from sglang_dflash.server.streaming import DONE, SSEResponse, sse
from sglang_dflash.server.tokenizer_manager import AsyncTokenizerManager


class OpenAIServing:
    def __init__(self, tokenizer_manager: AsyncTokenizerManager, model_name: str):
        self.tm = tokenizer_manager
        self.model = model_name

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        adapter.check_supported(body)
        ids = self.tm.chat_ids(adapter.chat_messages(body))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = adapter.sampling_params(body, max_tokens, len(ids), self.tm.context_length)
        req = self.tm.make_req(input_ids=ids, sampling_params=params)
        return await self.serve(req, body, request, adapter.ChatFormat(req.rid, self.model))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        adapter.check_supported(body)
        ids = adapter.completion_input_ids(body, self.tm.encode)
        params = adapter.sampling_params(body, body.max_tokens, len(ids), self.tm.context_length)
        req = self.tm.make_req(input_ids=ids, sampling_params=params)
        return await self.serve(req, body, request, adapter.CompletionFormat(req.rid, self.model))

    async def serve(
        self, req: Req, body: OpenAIRequest, request: Request, fmt: adapter.ChatFormat | adapter.CompletionFormat
    ) -> Response:
        if not body.stream:
            text, _, last = await self.tm.generate_all(req, request)
            return JSONResponse(fmt.response(text, last).model_dump(exclude_none=True))
        outputs = self.tm.generate(req, request)
        first = await anext(outputs)  # a refused request is a 400 here, before any byte of the stream
        usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncGenerator[str, None]:
            try:
                for chunk in fmt.opening():
                    yield sse(chunk)
                out = first
                while out is not None:
                    yield sse(fmt.chunk(out))
                    if out.finished and usage:
                        yield sse(fmt.usage_chunk(out))
                    out = None if out.finished else await anext(outputs, None)
                yield DONE
            finally:
                await outputs.aclose()

        return SSEResponse(events())
