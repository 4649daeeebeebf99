"""TpModelWorker: the target model worker. Runs prefill (EXTEND) and autoregressive DECODE steps."""

from __future__ import annotations

import torch

from sglang_dflash.engine.forward_batch import ForwardBatch
from sglang_dflash.engine.model_runner import ModelRunner
from sglang_dflash.engine.sampler import (
    SamplingBatchInfo,
    apply_penalties,
    draw_uniforms,
    penalty_state,
    sample,
)
from sglang_dflash.models.llama import LogitsOutput
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch


class TpModelWorker:
    """Owns the ModelRunner; one call runs one ScheduleBatch and samples one token per request."""

    def __init__(self, model_runner: ModelRunner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.vocab_size = model_runner.model_config.vocab_size

    def tokens_per_decode_step(self, req: Req) -> int:
        """KV slots a decode step may write beyond the committed length."""
        return 1

    def build_forward_batch(
        self, batch: ScheduleBatch, capture_layer_ids: tuple[int, ...] | None = None, logits: str = "last"
    ) -> ForwardBatch:
        reqs = batch.reqs
        pool = self.model_runner.req_to_token_pool
        if batch.forward_mode.is_extend():
            ids, prefix, extend = batch.extend_input_ids(), batch.prefix_lens, batch.extend_lens
        else:
            ids = [r.output_ids[-1] for r in reqs]
            prefix = [r.kv_committed_len for r in reqs]
            extend = [1] * len(reqs)
        return ForwardBatch.build(
            batch.forward_mode, ids, [r.req_pool_idx for r in reqs], prefix, extend, pool.req_to_token,
            self.device, logits=logits, capture_layer_ids=capture_layer_ids,
        )

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

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        return self.model_runner.forward(fb)

    def validate_request(self, req: Req) -> None:
        """Nothing to check for plain decoding."""

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        out = self.forward(self.build_forward_batch(batch))
        return self.sample_extend_or_decode(batch, out.next_token_logits)

    def sample_extend_or_decode(self, batch: ScheduleBatch, logits: torch.Tensor) -> GenerationBatchResult:
        """One next token for every request that has one (see rows_to_sample)."""
        rows = rows_to_sample(batch)
        next_ids = iter(self.sample([batch.reqs[i] for i in rows], logits[rows]).tolist())
        done = set(rows)
        return GenerationBatchResult([[next(next_ids)] if i in done else [] for i in range(len(batch.reqs))])


def rows_to_sample(batch: ScheduleBatch) -> list[int]:
    """Requests that get a next token: all in decode; in prefill, those whose chunk ends fill_ids."""
    if not batch.forward_mode.is_extend():
        return list(range(len(batch.reqs)))
    return [
        i for i, (r, p, e) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)) if p + e == r.seq_len
    ]
