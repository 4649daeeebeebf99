"""The HTTP server: a FastAPI app with OpenAI-compatible and SGLang-native routes, served by uvicorn.

One process: the event loop here (streaming), a tokenizer thread, the scheduler in its own thread, the
model worker under it. `build_app(server_args)` builds the components; `lifecycle.serve(app, server_args)`
blocks serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from sglang_dflash import __version__
from sglang_dflash.entrypoints.http.auth import APIKeyMiddleware
from sglang_dflash.entrypoints.http.errors import error_response, install_error_handlers
from sglang_dflash.entrypoints.http.limits import BodyLimitMiddleware
from sglang_dflash.entrypoints.http.metrics import Metrics
from sglang_dflash.entrypoints.http.openai_serving import OpenAIServing
from sglang_dflash.entrypoints.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from sglang_dflash.entrypoints.http.scheduler_thread import SchedulerThread
from sglang_dflash.entrypoints.http.streaming import stream_outputs
from sglang_dflash.entrypoints.http.tokenizer_manager import AsyncTokenizerManager
from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.scheduler.scheduler import Scheduler
from sglang_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


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
    app.state.tm, app.state.scheduler_thread = tm, scheduler_thread
    install_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(args.max_request_body_mb * 2**20))
    openai = OpenAIServing(tm, model_name, args.enable_cache_report)

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
        info["dtype"] = resolved_dtype(args)
        info.update(dataclasses.asdict(scheduler_thread.stats))
        info.update(version=__version__, served_model_name=model_name, context_length=tm.context_length)
        return info

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Empties the radix cache; like SGLang, a plain-text 400 while requests are waiting or running."""
        if await scheduler_thread.flush_cache():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: there are running or waiting requests.\n", status_code=400)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def native_reqs(tm: AsyncTokenizerManager, obj: GenerateReqInput) -> tuple[list[Req], bool]:
    """The Reqs of a /generate body (on the tokenizer thread) and whether it is a batch."""
    texts = obj.text if isinstance(obj.text, list) else None
    ids = obj.input_ids if obj.input_ids and isinstance(obj.input_ids[0], list) else None
    if obj.text is None and obj.input_ids is None:
        raise ValueError("give text or input_ids")
    if obj.text == [] or obj.input_ids == []:
        raise ValueError("text / input_ids is empty: give at least one prompt")
    if texts is None and ids is None:
        if isinstance(obj.sampling_params, list):
            raise ValueError("a single prompt takes one sampling_params dict")
        if isinstance(obj.rid, list):
            raise ValueError("a single prompt takes one rid string")
        return [tm.make_req(obj.text, obj.input_ids, obj.sampling_params, obj.rid)], False
    if obj.stream:
        raise ValueError("stream=True takes a single prompt")
    n = len(texts if texts is not None else ids)
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling_params for {n} prompts")
    rids = obj.rid if obj.rid is not None else [None] * n
    if not isinstance(rids, list) or len(rids) != n:
        raise ValueError(f"a batch of {n} prompts takes a list of {n} rids")
    given = [r for r in rids if r is not None]
    if len(set(given)) < len(given):
        raise ValueError("the rids of a batch must be distinct")
    return [tm.make_req(texts[i] if texts else None, ids[i] if ids else None, params[i], rids[i])
            for i in range(n)], True


async def generate_native(tm: AsyncTokenizerManager, obj: GenerateReqInput, request: Request) -> Response:
    """SGLang's /generate: {"text", "output_ids", "meta_info"} (a list of those for a batch). Streaming sends
    the text and ids so far in every event, as SGLang does."""
    reqs, batch = await tm.run(native_reqs, tm, obj)
    if batch:
        tm.admit(len(reqs))
        results = await asyncio.gather(*(tm.generate_all(r, request) for r in reqs))
        return JSONResponse([{"text": t, "output_ids": o, "meta_info": last.meta_info} for t, o, last in results])
    req = reqs[0]
    if not obj.stream:
        text, output_ids, last = await tm.generate_all(req, request)
        return JSONResponse({"text": text, "output_ids": output_ids, "meta_info": last.meta_info})
    outputs = tm.generate(req, request)
    first = await anext(outputs)  # a refused request is a 400 here

    text, output_ids = [], []

    def render(out):  # SGLang sends the text and ids so far in every event
        text.append(out.text)
        output_ids.extend(out.output_ids)
        return [{"text": "".join(text), "output_ids": list(output_ids), "meta_info": out.meta_info}]

    return stream_outputs(first, outputs, render)


def resolved_dtype(args: ServerArgs) -> str:
    return str(args.torch_dtype).removeprefix("torch.")


def build_app(args: ServerArgs) -> FastAPI:
    """Builds the engine components, warms up, starts the scheduler thread; ValueError or FileNotFoundError
    for bad flag values (model or drafter paths, sizes)."""
    from sglang_dflash.entrypoints.engine import build_components

    tokenizer_managers = []

    def build() -> Scheduler:  # on the scheduler thread, like every step after it
        tokenizer_manager, scheduler = build_components(args)
        scheduler.add_request(tokenizer_manager.make_req(input_ids=tokenizer_manager.encode("Hello"),
                                                         sampling_params={"max_new_tokens": 4}))
        while scheduler.has_work():  # warm-up
            scheduler.run_step()
        tokenizer_managers.append(tokenizer_manager)
        return scheduler

    model_name = served_model_name(args)
    metrics = Metrics(model_name)
    scheduler_thread = SchedulerThread(build, metrics)
    scheduler = scheduler_thread.scheduler
    tm = AsyncTokenizerManager(tokenizer_managers[0], scheduler_thread,
                               scheduler.max_running_requests + args.max_queued_requests, args.request_timeout_s)
    app = create_app(args, tm, scheduler_thread, metrics, model_name)
    logger.info("model %s: dtype %s, device %s, KV pool %d tokens, context %d, speculative %s", model_name,
                resolved_dtype(args), args.device, scheduler.allocator.size, tm.context_length,
                args.speculative_algorithm or "NONE")
    return app
