"""Engine: the offline API, like `sgl.Engine`. generate() runs all its prompts as one continuous batch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from sglang_dflash.entrypoints.tokenizer_manager import TokenizerManager
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.runtime.model_runner import ModelRunner
from sglang_dflash.runtime.tokenizer import load_tokenizer
from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.scheduler.scheduler import Scheduler
from sglang_dflash.server_args import ServerArgs
from sglang_dflash.speculative.drafter import default_drafter_path, resolve_block_size
from sglang_dflash.workers.tp_worker import TpModelWorker

logger = logging.getLogger(__name__)


def build_components(args: ServerArgs) -> tuple[TokenizerManager, Scheduler]:
    """Model runner, worker (AR or DFlash), scheduler and tokenizer manager for these args."""
    from sglang_dflash.device import resolve_device

    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    device = resolve_device(args.device)
    block = drafter = None
    reach = 1  # positions a decode step touches from the committed length on
    draft_kv_bytes = draft_weight_bytes = 0  # the draft pool shares the target's slots
    if args.speculative_algorithm == "DFLASH":
        drafter = args.speculative_draft_model_path or default_drafter_path(args.model_path)
        dcfg = DFlashConfig.load(drafter)
        block = resolve_block_size(args.speculative_num_draft_tokens, dcfg.block_size)
        reach = 2 * dcfg.block_size + 1  # a request may ask for the drafter's block; two blocks in flight
        draft_kv_bytes = 2 * dcfg.num_hidden_layers * dcfg.num_key_value_heads * dcfg.head_dim
        draft_kv_bytes *= args.torch_dtype.itemsize
        # the draft's weights in the target dtype: at most the file (of bf16 or wider weights) scaled to it
        file_bytes = (Path(drafter) / "model.safetensors").stat().st_size
        draft_weight_bytes = file_bytes * max(1, args.torch_dtype.itemsize // 2)
    runner = ModelRunner(
        args.model_path, device, args.torch_dtype, args.max_total_tokens, args.max_running_requests,
        args.context_length, tokens_past_committed=reach, mem_fraction_static=args.mem_fraction_static,
        extra_kv_bytes_per_token=draft_kv_bytes, reserved_bytes=draft_weight_bytes,
        batch_invariant=args.enable_deterministic_inference,
    )
    worker = TpModelWorker(runner)
    if block is not None:
        from sglang_dflash.workers.dflash_worker import DFlashWorker

        worker = DFlashWorker(worker, args, str(drafter), block)
    tokenizer = load_tokenizer(args.tokenizer_path or runner.model_dir)
    cfg = runner.model_config
    eos = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    tm = TokenizerManager(tokenizer, runner.context_length, eos)
    scheduler = Scheduler(
        worker, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, args.max_running_requests,
        args.chunked_prefill_size, enable_overlap=not args.disable_overlap_schedule,
        disable_radix_cache=args.disable_radix_cache, enable_mixed_chunk=args.enable_mixed_chunk,
    )
    return tm, scheduler


def result_of(req: Req) -> dict:
    return {"text": req.detokenizer.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()}


class Engine:
    """Offline engine. `Engine(model_path=None, device="cpu", dtype="auto", **server_args)`."""

    def __init__(self, model_path: str | None = None, **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.tokenizer_manager, self.scheduler = build_components(self.server_args)
        self.tokenizer = self.tokenizer_manager.tokenizer

    def _make_reqs(self, prompt, sampling_params, input_ids) -> tuple[list[Req], bool]:
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids = [input_ids] if single and input_ids is not None else input_ids
        n = len(prompts) if prompts is not None else len(ids or [])
        if n == 0:
            raise ValueError("give a prompt, a list of prompts, or input_ids")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        reqs = [
            self.tokenizer_manager.make_req(
                prompts[i] if prompts is not None else None, ids[i] if ids is not None else None, params[i]
            )
            for i in range(n)
        ]
        return reqs, single

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        reqs, single = self._make_reqs(prompt, sampling_params, input_ids)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(reqs[0])
        self._run(reqs)
        results = [result_of(r) for r in reqs]
        return results[0] if single else results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: dict | list[dict] | None = None):
        """Applies the model's chat template and generates; a list of conversations runs as one batch."""
        batch = bool(messages) and isinstance(messages[0], list)
        convs = messages if batch else [messages]
        ids = [self.tokenizer_manager.chat_ids(m) for m in convs]
        return self.generate(input_ids=ids if batch else ids[0], sampling_params=sampling_params)

    def _run(self, reqs: list[Req]) -> None:
        try:
            for r in reqs:
                self.scheduler.add_request(r)
            while any(not r.finished() for r in reqs):
                self.scheduler.run_step()
            self.scheduler.land()
        except BaseException:
            for r in reqs:
                self.scheduler.abort_request(r.rid, "error")
            self.scheduler.drain()
            raise

    def _stream(self, req: Req) -> Iterator[dict]:
        self.scheduler.add_request(req)
        try:
            while not req.finished():
                self.scheduler.run_step()
                delta = req.take_delta()
                if delta is not None:
                    yield {"text": delta[0], "output_ids": list(req.output_ids), "meta_info": req.meta_info()}
        finally:
            if not req.finished():
                self.scheduler.abort_request(req.rid, "stream closed")
            self.scheduler.land()

    def flush_cache(self) -> bool:
        """Empties the radix prefix cache (like `sgl.Engine.flush_cache`); False while requests are running."""
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        self.scheduler.abort_all("engine shutdown")
        self.scheduler.land()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
