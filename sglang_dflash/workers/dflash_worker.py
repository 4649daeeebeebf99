"""DFlashWorker: our engine's host of the shared DFlash step (sglang_dflash.speculative).

Prefill runs the target capturing the drafter's layers and materialises the prompt's draft context K/V.
Decode plans the step from the requests, then `DFlashStep.decode` proposes, asks this worker to verify
(one TARGET_VERIFY forward, penalties applied per row) and accepts; next inputs go to the FutureMap.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sglang_dflash.device import synchronize
from sglang_dflash.kernels.backend import ENV_VAR
from sglang_dflash.kernels.cpu_extensions import sources_digest
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool
from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.sampling.sampler import SamplingBatchInfo, apply_penalties, draw_uniforms, penalty_state
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch
from sglang_dflash.server_args import ServerArgs
from sglang_dflash.speculative.accept import block_history
from sglang_dflash.speculative.cost_model import CostModel, calibrate, load_or_calibrate, probe
from sglang_dflash.speculative.dflash_step import DFlashStep
from sglang_dflash.speculative.draft_block import DraftBlock
from sglang_dflash.speculative.drafter import load_drafter
from sglang_dflash.speculative.policy import Plan, ReqSpecState, SpecOptions, SpecPolicy, step_shape
from sglang_dflash.workers.tp_worker import TpModelWorker

logger = logging.getLogger(__name__)


class DFlashWorker:
    def __init__(self, target_worker: TpModelWorker, server_args: ServerArgs, drafter_path: str, block_size: int):
        self.target = target_worker
        runner = target_worker.model_runner
        self.device = runner.device
        model = runner.model
        draft = load_drafter(drafter_path, self.device, runner.dtype, runner.model_config, model.model.embed_tokens,
                             model.lm_head, server_args.enable_deterministic_inference)
        cfg = draft.config
        self.block_size = block_size
        self.capture_layer_ids = tuple(cfg.target_layer_ids)
        self.req_to_token = runner.req_to_token_pool.req_to_token
        pool = MHATokenToKVPool(runner.max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                cfg.head_dim, runner.dtype, self.device)
        a = server_args
        options = SpecOptions(cfg.block_size, a.speculative_adaptive, a.speculative_lookup,
                              a.speculative_lookup_min_match, a.speculative_lookup_max_match)
        self.step = DFlashStep(draft, pool, SpecPolicy(options, None))
        if options.adaptive:
            self.step.policy.cost = self.cost_model(server_args, drafter_path)
        self.batch: ScheduleBatch | None = None  # the batch being verified, its sampling info and KV bound
        self.info: SamplingBatchInfo | None = None
        self.kv_bound = 0
        logger.info("DFlash drafter %s: %d layers, block %d, target layers %s, adaptive %s, lookup %s", drafter_path,
                    cfg.num_hidden_layers, block_size, list(self.capture_layer_ids), options.adaptive, options.lookup)

    # ---- scheduler interface ----
    def block_size_of(self, req: Req) -> int:
        return req.sampling_params.speculative_num_draft_tokens or self.block_size

    def tokens_per_decode_step(self, req: Req) -> int:
        return self.block_size_of(req)

    def validate_request(self, req: Req) -> None:
        n = req.sampling_params.speculative_num_draft_tokens
        limit = self.step.draft.config.block_size
        if n is not None and n > limit:
            raise ValueError(
                f"sampling_params.speculative_num_draft_tokens={n} exceeds the drafter's block size {limit}"
            )

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        with torch.inference_mode():
            if batch.forward_mode.is_extend():
                return self.forward_extend(batch)
            return self.forward_decode(batch)

    # ---- prefill ----
    def forward_extend(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fb = self.target.build_extend_batch(batch, capture_layer_ids=self.capture_layer_ids)
        out = self.target.forward(fb)
        self.step.prefill(batch.reqs, out.hidden_states, fb.positions, fb.out_cache_loc, self.req_to_token,
                          batch.req_pool_indices, batch.prefix_lens)
        return self.target.finish_extend(batch, fb, out.next_token_logits)

    # ---- decode ----
    def forward_decode(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Plan, then the shared step; no host sync (inputs come from the FutureMap)."""
        start = time.perf_counter()
        rpi = self.target.req_pool_indices(batch)
        bonus, seq_lens = self.target.future_map.read(rpi)
        states, plans = self.plan(batch)
        kv_bound = batch.kv_bound
        if batch.host_current:  # the host knows every committed length: bound attention by what this step reads
            kv_bound = min(kv_bound, max(r.kv_committed_len + p.block_len for r, p in zip(batch.reqs, plans)))
        self.batch, self.kv_bound = batch, kv_bound
        self.info = SamplingBatchInfo.from_params([r.sampling_params for r in batch.reqs], self.target.vocab_size,
                                                  self.device)
        out = self.step.decode(self, self.req_to_token, rpi, seq_lens, bonus, states, plans, kv_bound)
        self.batch = self.info = None
        self.target.future_map.publish(rpi, out.next_bonus, out.new_seq_lens)
        cost = self.step.policy.cost
        if cost is not None and self.device.type == "cpu":  # a synchronous device: the wall time is the step's
            cost.observe(*step_shape(plans), time.perf_counter() - start)
        return GenerationBatchResult(out.out_tokens, out.accept_lens, out.block_lens, plans)

    def plan(self, batch: ScheduleBatch) -> tuple[list[ReqSpecState], list[Plan]]:
        """Each request's proposer state and plan; no block longer than the tokens a request may still emit."""
        limits = [self.block_size_of(r) for r in batch.reqs]
        if self.step.policy.options.adaptive:
            limits = [max(1, min(n, r.sampling_params.max_new_tokens - len(r.output_ids)))
                      for n, r in zip(limits, batch.reqs)]
        return self.step.plan(batch.reqs, batch.host_current, limits)

    # ---- the cost model of a step ----
    def cost_model(self, server_args: ServerArgs, drafter_path: str) -> CostModel:
        """Calibrated once per device, model, drafter, dtype and thread count (cached on disk)."""
        runner = self.target.model_runner
        key = {"calibration": 8, "kernels": os.environ.get(ENV_VAR, ""), "sources": sources_digest(),
               "device": str(self.device),
               "model": str(runner.model_dir),
               "drafter": str(drafter_path), "dtype": str(runner.dtype), "threads": torch.get_num_threads(),
               "block": self.block_size, "cpu": platform.processor() or platform.machine()}
        max_tokens = min(256, server_args.max_running_requests * self.block_size, runner.max_total_tokens,
                         self.req_to_token.shape[1])  # one request row holds the calibration's tokens

        def full() -> CostModel:
            with self.timed_forwards(max_tokens) as (verify, draft, sync):
                return calibrate(verify, draft, sync, max_tokens, self.block_size)

        def check() -> dict[int, float]:
            with self.timed_forwards(max_tokens) as (verify, _, sync):
                return probe(verify, sync, max_tokens)

        return load_or_calibrate(key, full, check)

    @contextmanager
    def timed_forwards(self, max_tokens: int) -> Iterator[tuple[Callable, Callable, Callable]]:
        """(verify(n), draft(n), sync) for timing: a verify-like target forward over n tokens of one request (+
        materialisation), a draft forward over n tokens; on a request row and slots held meanwhile."""
        runner = self.target.model_runner
        row = runner.req_to_token_pool.alloc()
        slots = runner.token_to_kv_pool_allocator.alloc(max_tokens)
        try:
            self.req_to_token[row, :max_tokens] = slots
            rpi = torch.tensor([row], device=self.device)

            def verify(n: int) -> None:
                fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [0] * n, [row], [0], [n], self.req_to_token,
                                        self.device, logits="all", capture_layer_ids=self.capture_layer_ids)
                out = self.target.forward(fb)
                self.step.materialize(out.hidden_states, fb.positions, fb.out_cache_loc)

            def draft(n: int) -> None:
                rows = n // self.block_size
                zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
                self.step.draft_block(self.req_to_token, rpi.expand(rows), zeros, zeros, [self.block_size] * rows,
                                      self.block_size)

            with torch.inference_mode():
                yield verify, draft, lambda: synchronize(self.device)
        finally:
            runner.token_to_kv_pool_allocator.free(slots)
            runner.req_to_token_pool.free(row)

    # ---- VerifyHost ----
    def verify(self, block: DraftBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """One TARGET_VERIFY forward over the verified tokens of every request's block; logits [T, V],
        features [T, F]."""
        fb = ForwardBatch.build_from_device(
            ForwardMode.TARGET_VERIFY, block.verified(block.candidates), block.req_pool_indices, block.seq_lens,
            block.block_lens_cpu, self.kv_bound, self.req_to_token, capture_layer_ids=self.capture_layer_ids,
            extend_lens_device=block.block_lens,
        )
        out = self.target.forward(fb)
        logits = out.next_token_logits
        if self.info.any_penalty:
            logits = self.penalised(block, logits, self.info)
        return logits, out.hidden_states

    def sampling(self, block: DraftBlock) -> tuple[SamplingBatchInfo | None, torch.Tensor | None]:
        if self.info.all_greedy:
            return None, None
        return self.info, draw_uniforms([r.generator for r in self.batch.reqs], block.width + 1, self.device)

    def penalised(self, block: DraftBlock, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Penalties per verified row: row j of a block sees the drafts d1..dj as generated tokens."""
        reqs = self.batch.reqs
        counts, seen = penalty_state([r.output_ids for r in reqs], [r.origin_input_ids for r in reqs],
                                     logits.shape[-1], self.device)
        row_counts = block_history(counts, block.candidates)
        row_seen = seen[:, None] | (row_counts > 0)
        return apply_penalties(logits, info.expand(block.block_lens, block.num_tokens), block.verified(row_counts),
                               block.verified(row_seen))
