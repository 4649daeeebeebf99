"""TpModelWorker: the target model worker. Runs prefill (EXTEND) and autoregressive DECODE steps.

Decode inputs (last token, committed length) are read from the FutureMap on the device, so a step
can be launched before the host has processed the previous one (overlap scheduling)."""

from __future__ import annotations

import torch

from sglang_dflash.device import upload
from sglang_dflash.models.llama import LogitsOutput
from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.runtime.model_runner import ModelRunner
from sglang_dflash.sampling.sampler import (
    SamplingBatchInfo,
    apply_penalties,
    draw_uniforms,
    penalty_state,
    sample,
)
from sglang_dflash.scheduler.future_map import FutureMap
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch


class TpModelWorker:
    """Owns the ModelRunner; one call runs one ScheduleBatch and samples one token per request."""

    def __init__(self, model_runner: ModelRunner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.vocab_size = model_runner.model_config.vocab_size
        self.future_map = FutureMap(model_runner.req_to_token_pool.size, self.device)

    def tokens_per_decode_step(self, req: Req) -> int:
        """KV slots a decode step may write beyond the committed length."""
        return 1

    def validate_request(self, req: Req) -> None:
        """Nothing to check for plain decoding."""

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        return self.model_runner.forward(fb)

    def req_pool_indices(self, batch: ScheduleBatch) -> torch.Tensor:
        return upload(batch.req_pool_indices, torch.int64, self.device)

    def build_extend_batch(self, batch: ScheduleBatch, capture_layer_ids: tuple[int, ...] | None = None):
        return ForwardBatch.build(
            ForwardMode.EXTEND, batch.input_ids, batch.req_pool_indices, batch.prefix_lens,
            batch.extend_lens, self.model_runner.req_to_token_pool.req_to_token, self.device,
            capture_layer_ids=capture_layer_ids,
        )

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        if batch.forward_mode.is_extend():
            fb = self.build_extend_batch(batch)
            return self.finish_extend(batch, fb, self.forward(fb).next_token_logits)
        rpi = self.req_pool_indices(batch)
        input_ids, prefix = self.future_map.read(rpi)
        fb = ForwardBatch.build_from_device(
            ForwardMode.DECODE, input_ids, rpi, prefix, [1] * len(batch.reqs),
            batch.kv_bound, self.model_runner.req_to_token_pool.req_to_token,
        )
        next_ids = self.sample(batch.reqs, self.forward(fb).next_token_logits)
        self.future_map.publish(rpi, next_ids, fb.seq_lens)
        return GenerationBatchResult(next_ids[:, None])

    def finish_extend(self, batch: ScheduleBatch, fb: ForwardBatch, logits: torch.Tensor) -> GenerationBatchResult:
        """Samples the first token of every request whose prefill completes; publishes it."""
        out = torch.full((len(batch.reqs), 1), -1, dtype=torch.int64, device=self.device)
        rows = batch.sample_rows
        if rows:
            idx = upload(rows, torch.int64, self.device)
            ids = self.sample([batch.reqs[i] for i in rows], logits[idx])
            out[idx, 0] = ids
            self.future_map.publish(fb.req_pool_indices[idx], ids, fb.seq_lens[idx])
        return GenerationBatchResult(out)

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(params, self.vocab_size, self.device)
        if info.any_penalty:
            counts, seen = penalty_state(
                [r.output_ids for r in reqs], [r.origin_input_ids for r in reqs], self.vocab_size, self.device
            )
            logits = apply_penalties(logits, info, counts, seen)
        uniforms = None if info.all_greedy else draw_uniforms([r.generator for r in reqs], 1, self.device)[:, 0]
        return sample(logits, info, uniforms)

