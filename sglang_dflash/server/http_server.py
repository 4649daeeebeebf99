"""The HTTP server: a FastAPI app with OpenAI-compatible and SGLang-native routes, served by uvicorn.

One process: the event loop here (tokenising, streaming), the scheduler in its own thread, the model
worker under it. `build_app(server_args)` builds the components; `serve(app, server_args)` blocks serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from sglang_dflash import __version__
from sglang_dflash.server.auth import APIKeyMiddleware
from sglang_dflash.server.errors import error_response, install_error_handlers
from sglang_dflash.server.metrics import Metrics
from sglang_dflash.server.openai_serving import OpenAIServing
from sglang_dflash.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from sglang_dflash.server.scheduler_thread import SchedulerThread
from sglang_dflash.server.streaming import DONE, SSEResponse, sse
from sglang_dflash.server.tokenizer_manager import AsyncTokenizerManager
from sglang_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
GRACEFUL_SHUTDOWN_S = 5


def served_model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path:
        return args.model_path
    from sglang_dflash.models.default_model import DEFAULT_MODEL_FILE

    return DEFAULT_MODEL_FILE.split(".")[0]


def create_app(
    args: ServerArgs, tm: AsyncTokenizerManager, scheduler_thread: SchedulerThread, metrics: Metrics, model_name: str
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler_thread.shutdown()

    app = FastAPI(title="sglang-dflash", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    openai = OpenAIServing(tm, model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await openai.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await openai.completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=model_name, root=args.model_path, max_model_len=tm.context_length)
        return ModelList(data=[card]).model_dump()

    @app.post("/generate")
    async def generate(obj: GenerateReqInput, request: Request) -> Response:
        return await generate_native(tm, obj, request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        req = tm.make_req(input_ids=tm.encode("Hello"), sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(tm.generate_all(req), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(503, f"no token generated in {HEALTH_GENERATE_TIMEOUT_S:.0f}s")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path, "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        info = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
        info.update(dataclasses.asdict(scheduler_thread.stats))
        info.update(version=__version__, served_model_name=model_name, context_length=tm.context_length)
        return info

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        stats = scheduler_thread.stats
        if stats.num_running_reqs or stats.num_waiting_reqs:
            return error_response(400, "Cache not flushed: there are pending requests.")
        return Response("Cache flushed (this engine keeps no prefix cache).\n", status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def generate_native(tm: AsyncTokenizerManager, obj: GenerateReqInput, request: Request) -> Response:
    """SGLang's /generate: {"text", "output_ids", "meta_info"} (a list of those for a batch). Streaming sends
    the text and ids so far in every event, as SGLang does."""
    texts = obj.text if isinstance(obj.text, list) else None
    ids = obj.input_ids if obj.input_ids and isinstance(obj.input_ids[0], list) else None
    if obj.text is None and obj.input_ids is None:
        raise ValueError("give text or input_ids")
    if texts is not None or ids is not None:
        if obj.stream:
            raise ValueError("stream=True takes a single prompt")
        n = len(texts if texts is not None else ids)
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        reqs = [tm.make_req(texts[i] if texts else None, ids[i] if ids else None, params[i]) for i in range(n)]
        results = await asyncio.gather(*(tm.generate_all(r, request) for r in reqs))
        return JSONResponse([{"text": t, "output_ids": o, "meta_info": last.meta_info} for t, o, last in results])
    if isinstance(obj.sampling_params, list):
        raise ValueError("a single prompt takes one sampling_params dict")
    req = tm.make_req(obj.text, obj.input_ids, obj.sampling_params, obj.rid)
    if not obj.stream:
        text, output_ids, last = await tm.generate_all(req, request)
        return JSONResponse({"text": text, "output_ids": output_ids, "meta_info": last.meta_info})
    outputs = tm.generate(req, request)
    first = await anext(outputs)  # a refused request is a 400 here

    async def events() -> AsyncGenerator[str, None]:
        text, output_ids, out = "", [], first
        try:
            while out is not None:
                text += out.text
                output_ids += out.output_ids
                yield sse({"text": text, "output_ids": output_ids, "meta_info": out.meta_info})
                out = None if out.finished else await anext(outputs, None)
            yield DONE
        finally:
            await outputs.aclose()

    return SSEResponse(events())


def build_app(args: ServerArgs) -> FastAPI:
    """Builds the engine components, warms up, starts the scheduler thread; ValueError or FileNotFoundError
    for bad flag values (model or drafter paths, sizes)."""
    from sglang_dflash.engine.engine import build_components

    tokenizer_manager, scheduler = build_components(args)
    model_name = served_model_name(args)
    metrics = Metrics(model_name)
    scheduler_thread = SchedulerThread(scheduler, not args.disable_overlap_schedule, metrics)
    tm = AsyncTokenizerManager(tokenizer_manager, scheduler_thread)
    scheduler_thread.warmup(tm.make_req(input_ids=tm.encode("Hello"), sampling_params={"max_new_tokens": 4}))
    app = create_app(args, tm, scheduler_thread, metrics, model_name)
    scheduler_thread.start()
    return app


def serve(app: FastAPI, args: ServerArgs) -> None:
    """Serves until interrupted; open streams get a few seconds to end (then they are aborted)."""
    logger.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=5,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
