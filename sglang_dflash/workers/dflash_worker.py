"""DFlashWorker: lossless block-diffusion speculative decoding around the target worker.

One decode step for the whole batch: draft forward on [bonus, MASK x (B-1)] per request ->
one batched TARGET_VERIFY forward -> accept (greedy or rejection sampling) -> commit ->
just-in-time materialisation of the committed rows' context K/V into the draft pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_dflash.engine.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.engine.memory_pool import MHATokenToKVPool
from sglang_dflash.engine.sampler import (
    SamplingBatchInfo,
    apply_penalties,
    draw_uniforms,
    logits_to_probs,
    penalty_state,
)
from sglang_dflash.kernels import greedy_accept, sampling_accept
from sglang_dflash.models.dflash import DFlashDraftModel, load_draft_model
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch
from sglang_dflash.server_args import ServerArgs
from sglang_dflash.workers.tp_worker import TpModelWorker

logger = logging.getLogger(__name__)

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTER = DRAFTERS_DIR / "smollm2-135m-instruct-dflash"


def default_drafter_path(model_path: str | None) -> Path:
    """The drafter shipped for the default target model."""
    from sglang_dflash.models.default_model import default_model_path

    is_default = model_path is None or Path(model_path).resolve() == default_model_path().resolve()
    if not is_default:
        raise ValueError("speculative_algorithm='DFLASH' needs speculative_draft_model_path for this target model")
    if not (DEFAULT_DRAFTER / "model.safetensors").is_file():
        raise ValueError(
            f"no default DFlash drafter is installed ({DEFAULT_DRAFTER}); pass speculative_draft_model_path"
        )
    return DEFAULT_DRAFTER


def propose_block(
    draft: DFlashDraftModel, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    rpi: torch.Tensor, bonus: torch.Tensor, prefix: torch.Tensor, block_lens: torch.Tensor, block: int, kv_bound: int,
) -> torch.Tensor:
    """Draft tokens [bs, block-1] from one draft forward over the padded blocks [bonus, MASK, ...].

    `req_to_token[rpi]` rows hold each request's context slots followed by its block slots; the draft
    K/V cache (`k_buffer`/`v_buffer`) is indexed by the same slots. Padded rows write into slot 0."""
    bs = rpi.shape[0]
    device = bonus.device
    cols = torch.arange(block, device=device)
    positions = prefix[:, None] + cols[None, :]
    input_ids = torch.where(cols[None, :] == 0, bonus[:, None], draft.config.mask_token_id)
    in_block = cols[None, :] < block_lens[:, None]
    slots = req_to_token[rpi[:, None], positions.clamp(max=req_to_token.shape[1] - 1)].long()
    out_cache_loc = torch.where(in_block, slots, 0)
    kv_indices = req_to_token[rpi, :kv_bound].long()
    hidden = draft(
        input_ids.flatten(), positions.flatten(), out_cache_loc.flatten(), kv_indices, prefix + block_lens, block,
        k_buffer, v_buffer,
    )
    if block == 1:
        return torch.empty(bs, 0, dtype=torch.int64, device=device)
    logits = draft.compute_logits(hidden.view(bs, block, -1)[:, 1:].reshape(bs * (block - 1), -1))
    return draft.map_draft_tokens(logits.argmax(-1)).view(bs, block - 1)


def block_target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Verify logits [bs, B, V] (penalties applied) -> the target distribution of every row, as the plain
    sampler defines it (temperature, top-k, top-p, min-p); greedy requests get one-hot argmax rows."""
    bs, block, vocab = logits.shape
    flat = logits.reshape(bs * block, vocab)
    row_info = info.expand(torch.full((bs,), block, device=logits.device))
    probs = logits_to_probs(flat, row_info)
    probs = torch.where(row_info.greedy[:, None], F.one_hot(flat.argmax(-1), vocab).to(probs.dtype), probs)
    return probs.view(bs, block, vocab)


@dataclass
class VerifyInput:
    """Padded [bs, B] view of a decode step: candidates = [bonus, d1, ...] per request."""

    candidates: torch.Tensor  # [bs, B] int64
    block_lens: torch.Tensor  # [bs] int64
    blocks: list[int]

    def in_block(self) -> torch.Tensor:
        """[bs, B] bool: columns inside each request's own block."""
        cols = torch.arange(self.candidates.shape[1], device=self.candidates.device)
        return cols[None, :] < self.block_lens[:, None]


class DFlashWorker:
    def __init__(self, target_worker: TpModelWorker, server_args: ServerArgs):
        self.target = target_worker
        runner = target_worker.model_runner
        self.device = runner.device
        path = server_args.speculative_draft_model_path or default_drafter_path(server_args.model_path)
        self.draft: DFlashDraftModel = load_draft_model(path, self.device, runner.dtype)
        cfg = self.draft.config
        cfg.check_target(runner.model_config)
        self.draft.bind_target(runner.model.model.embed_tokens, runner.model.lm_head)
        self.draft.prepare_inference(self.device)
        self.block_size = server_args.speculative_num_draft_tokens or cfg.block_size
        if not 1 <= self.block_size <= cfg.block_size:
            raise ValueError(
                f"speculative_num_draft_tokens={self.block_size} must be in [1, {cfg.block_size}] for this drafter"
            )
        runner.reserve_tokens_per_step(2 * cfg.block_size)
        self.capture_layer_ids = tuple(cfg.target_layer_ids)
        self.draft_pool = MHATokenToKVPool(
            runner.max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, runner.dtype,
            self.device,
        )
        self.req_to_token = runner.req_to_token_pool.req_to_token
        logger.info("DFlash drafter %s: %d layers, block %d, target layers %s", path, cfg.num_hidden_layers,
                    self.block_size, list(self.capture_layer_ids))

    # ---- scheduler interface ----
    def block_size_of(self, req: Req) -> int:
        return req.sampling_params.speculative_num_draft_tokens or self.block_size

    def tokens_per_decode_step(self, req: Req) -> int:
        return self.block_size_of(req)

    def validate_request(self, req: Req) -> None:
        n = req.sampling_params.speculative_num_draft_tokens
        if n is not None and n > self.draft.config.block_size:
            raise ValueError(
                f"sampling_params.speculative_num_draft_tokens={n} exceeds the drafter's block size "
                f"{self.draft.config.block_size}"
            )

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        if batch.forward_mode.is_extend():
            return self.forward_extend(batch)
        return self.forward_decode(batch)

    # ---- prefill ----
    def forward_extend(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fb = self.target.build_extend_batch(batch, capture_layer_ids=self.capture_layer_ids)
        out = self.target.forward(fb)
        self.materialize(out.hidden_states, fb.positions, fb.out_cache_loc)
        return self.target.finish_extend(batch, fb, out.next_token_logits)

    def materialize(self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        with torch.inference_mode():
            self.draft.materialize_context_kv(
                features, positions, out_cache_loc, self.draft_pool.k_buffer, self.draft_pool.v_buffer
            )

    # ---- decode ----
    def forward_decode(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Draft, verify, accept, materialise, publish: no host sync (inputs come from the FutureMap)."""
        reqs = batch.reqs
        blocks = [self.block_size_of(r) for r in reqs]
        kv_bound = batch.kv_bound  # >= committed + block for every request
        rpi = self.target.req_pool_indices(batch)
        bonus, prefix = self.target.future_map.read(rpi)
        block_lens = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            drafts = self.propose(rpi, bonus, prefix, block_lens, max(blocks), kv_bound)
            vin = VerifyInput(torch.cat([bonus[:, None], drafts], dim=1), block_lens, blocks)
            fb, logits, hidden = self.verify(rpi, prefix, vin, kv_bound)
            accept_lens, next_bonus, out_tokens = self.accept(reqs, vin, logits)
            # context K/V for the committed rows only; the other rows write the padding slot 0
            cols = torch.arange(vin.candidates.shape[1], device=self.device)
            committed = (cols[None, :] <= accept_lens[:, None])[vin.in_block()]
            self.materialize(hidden, fb.positions, torch.where(committed, fb.out_cache_loc, 0))
            self.target.future_map.publish(rpi, next_bonus, prefix + accept_lens + 1)
        return GenerationBatchResult(out_tokens, accept_lens=accept_lens, block_sizes=blocks)

    def propose(
        self, rpi: torch.Tensor, bonus: torch.Tensor, prefix: torch.Tensor, block_lens: torch.Tensor, block: int,
        kv_bound: int,
    ) -> torch.Tensor:
        return propose_block(
            self.draft, self.draft_pool.k_buffer, self.draft_pool.v_buffer, self.req_to_token, rpi, bonus, prefix,
            block_lens, block, kv_bound,
        )

    def verify(
        self, rpi: torch.Tensor, prefix: torch.Tensor, vin: VerifyInput, kv_bound: int
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """One TARGET_VERIFY forward over every request's block; logits padded to [bs, B, V]."""
        bs, block = vin.candidates.shape
        in_block = vin.in_block()
        fb = ForwardBatch.build_from_device(
            ForwardMode.TARGET_VERIFY, vin.candidates[in_block], rpi, prefix, vin.blocks, kv_bound,
            self.req_to_token, capture_layer_ids=self.capture_layer_ids,
        )
        out = self.target.forward(fb)
        logits = out.next_token_logits.new_zeros(bs, block, out.next_token_logits.shape[-1])
        logits[in_block] = out.next_token_logits
        return fb, logits, out.hidden_states

    def accept(self, reqs: list[Req], vin: VerifyInput, logits: torch.Tensor):
        """Greedy or lossless rejection sampling; penalties see the block tokens before each row."""
        bs, block, vocab = logits.shape
        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(params, vocab, self.device)
        flat = logits.view(bs * block, vocab)
        if info.any_penalty:
            flat = self.penalised(reqs, vin, flat, info)
        if info.all_greedy:
            return greedy_accept(vin.candidates, flat.argmax(-1).view(bs, block), vin.block_lens)
        probs = block_target_probs(flat.view(bs, block, vocab), info)
        uniforms = draw_uniforms([r.generator for r in reqs], block + 1, self.device)
        return sampling_accept(probs, vin.candidates, None, vin.block_lens, uniforms[:, :block], uniforms[:, block])

    def penalised(self, reqs: list[Req], vin: VerifyInput, flat: torch.Tensor, info: SamplingBatchInfo):
        bs, block = vin.candidates.shape
        vocab = flat.shape[-1]
        counts, seen = penalty_state(
            [r.output_ids for r in reqs], [r.origin_input_ids for r in reqs], vocab, self.device
        )
        # row j of a block follows the drafts d1..dj: add them to the history of that row
        drafts = F.one_hot(vin.candidates[:, 1:], vocab).to(counts.dtype)
        before = torch.cat([counts.new_zeros(bs, 1, vocab), drafts.cumsum(1)], dim=1)  # [bs, B, V]
        row_counts = (counts[:, None] + before).view(bs * block, vocab)
        row_seen = (seen[:, None] | (before > 0)).view(bs * block, vocab)
        row_info = info.expand(torch.full((bs,), block, device=self.device))
        return apply_penalties(flat, row_info, row_counts, row_seen)
