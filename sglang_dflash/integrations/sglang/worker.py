"""DFlashSGLangWorker: sglang_dflash's DFlash decoding behind SGLang's Spec-V2 worker contract.

The drafter, the block proposal, the accept kernels and the context-KV materialisation are the ones our own
engine uses; SGLang supplies the target forward (prefill with aux hidden-state capture, TARGET_VERIFY), the
KV slots (req_to_token), the FutureMap relay and the scheduler. The draft K/V cache is keyed by SGLang's token
slots, so radix-cache prefix hits and chunked prefill find the draft context of earlier tokens in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.layers.sampler import apply_custom_logit_processor
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask
from torch import nn

from sglang_dflash.device import memory_info
from sglang_dflash.integrations.sglang.draft_input import DFlashDraftInput
from sglang_dflash.integrations.sglang.hooks import missing_hooks
from sglang_dflash.integrations.sglang.penalties import PenaltyState, has_penalties
from sglang_dflash.integrations.sglang.routing import ALGORITHM, DFlashSpecAlgo, drafter_dir, spec_options
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool
from sglang_dflash.sampling.sampler import SamplingBatchInfo
from sglang_dflash.speculative.dflash_step import DFlashStep
from sglang_dflash.speculative.draft_block import DraftBlock
from sglang_dflash.speculative.drafter import load_drafter
from sglang_dflash.speculative.policy import SpecPolicy

logger = logging.getLogger(__name__)


class TargetHead(nn.Module):
    """The target's lm_head weight as a linear layer (SGLang's ParallelLMHead has no forward)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def extend_positions(prefix_lens: list[int], extend_lens: list[int], device: torch.device) -> torch.Tensor:
    """Positions of the tokens a prefill computes: prefix_i .. prefix_i + extend_i - 1 per request."""
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    starts = torch.tensor(prefix_lens, dtype=torch.int64) - (lens.cumsum(0) - lens)
    return (torch.arange(int(lens.sum())) + starts.repeat_interleave(lens)).to(device)


def sampling_batch_info(info: Any, reqs: list, vocab: int) -> SamplingBatchInfo:
    """SGLang's per-request sampling tensors as our sampler's (penalties are applied to the logits beforehand); the
    sampled rows from the requests' parameters on the host (SGLang's greedy is top_k <= 1)."""
    top_ks = info.top_ks.to(torch.int64).clamp(max=vocab)
    ones = torch.ones_like(info.top_ps, dtype=torch.float32)
    zeros = torch.zeros_like(ones)
    return SamplingBatchInfo(
        temperatures=info.temperatures.reshape(-1).float(), top_ps=info.top_ps.float(), top_ks=top_ks,
        min_ps=info.min_ps.float(), greedy=top_ks <= 1, repetition=ones, frequency=zeros, presence=zeros,
        all_greedy=bool(info.is_all_greedy),
        sampled_rows=[i for i, r in enumerate(reqs) if r.sampling_params.top_k > 1], any_penalty=False,
        need_top_p=bool(info.need_top_p_sampling),
        need_top_k=bool(info.need_top_k_sampling), need_min_p=bool(info.need_min_p_sampling),
    )


class DFlashSGLangWorker(BaseSpecWorker):
    """Built by SGLang's scheduler as Cls(server_args, gpu_id, nccl_port, target_worker); from then on it runs
    every forward: prefill (target + draft context K/V) and decode (draft block, verify, accept, publish)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        runner = target_worker.model_runner
        if not isinstance(runner.spec_algorithm, DFlashSpecAlgo):
            raise RuntimeError(f"sglang_dflash worker built for algorithm {runner.spec_algorithm!r}, not {ALGORITHM}")
        missing = missing_hooks()
        if missing:
            raise RuntimeError(f"sglang_dflash: SGLang did not apply the hooks on {missing} (see its log)")
        if get_parallel().tp_size != 1 or get_parallel().attn_dp_enabled:
            raise NotImplementedError("sglang_dflash's DFLASH worker supports tp_size 1 without dp attention only")
        self.device = torch.device(target_worker.device)
        spec = get_spec()
        self.block_size = int(spec.speculative_num_draft_tokens)
        path = drafter_dir(spec.speculative_draft_model_path)
        model = runner.model
        target_cfg = runner.model_config.hf_text_config
        self.draft = load_drafter(path, self.device, runner.dtype, target_cfg, model.model.embed_tokens,
                                  TargetHead(model.lm_head.weight),
                                  bool(getattr(server_args, "enable_deterministic_inference", False)))
        cfg = self.draft.config
        if max(cfg.target_layer_ids) > target_cfg.num_hidden_layers - 2:
            raise ValueError(f"SGLang captures target layers 0..{target_cfg.num_hidden_layers - 2} only, "
                             f"the drafter needs {cfg.target_layer_ids}")
        model.set_dflash_layers_to_capture(list(cfg.target_layer_ids))
        self.generator = torch.Generator(self.device).manual_seed(server_args.random_seed or 0)
        # SGLang's own host lists are current only without its overlap loop: lookup needs them
        self.host_current = bool(server_args.disable_overlap_schedule)
        self.policy = SpecPolicy(spec_options(self.block_size, adaptive=False), None)
        self.step: DFlashStep | None = None  # made with the draft pool, once SGLang sized its KV pool
        self.penalties: PenaltyState | None = None  # made when the first request with penalties arrives
        self.verifying: tuple[ScheduleBatch, Callable[[], None] | None] | None = None  # the step's batch
        self.verify_output: tuple[Any, bool] | None = None  # its logits output, for SGLang's result
        logger.info(
            "sglang_dflash: speculative algorithm %s runs %s.%s (drafter %s: %d layers, block %d, target layers %s)",
            ALGORITHM, type(self).__module__, type(self).__qualname__, path, cfg.num_hidden_layers,
            self.block_size, list(cfg.target_layer_ids),
        )

    def __getattr__(self, name: str) -> Any:
        # The scheduler treats this worker as its model worker: delegate what only the target has.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    @property
    def preloaded_weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.draft.parameters())

    def alloc_memory_pool(
        self, memory_pool_config: Any = None, req_to_token_pool: Any = None, token_to_kv_pool_allocator: Any = None
    ) -> None:
        """Stores SGLang's pools; the draft K/V cache gets one row per target KV slot (SGLang's memory budget does
        not count it: too little memory left gets a clear error, not an out-of-memory)."""
        super().alloc_memory_pool(memory_pool_config, req_to_token_pool, token_to_kv_pool_allocator)
        cfg = self.draft.config
        slots = self.target_worker.model_runner.token_to_kv_pool.get_key_buffer(0).shape[0]
        need = 2 * slots * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        need *= self.draft.fc.weight.element_size()
        free, total = memory_info(self.device)
        if need > free:
            raise RuntimeError(f"sglang_dflash: the draft KV pool needs {need / 2**30:.2f} GiB for {slots} slots, "
                               f"{free / 2**30:.2f} GiB are free: lower --mem-fraction-static by at least "
                               f"{(need - free) / total:.3f} or set --max-total-tokens")
        pool = MHATokenToKVPool(
            slots - 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.draft.fc.weight.dtype,
            self.device,
        )
        self.step = DFlashStep(self.draft, pool, self.policy)

    # ---- the Spec-V2 call ----
    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish: Callable[[torch.Tensor], None] | None = None,
        grammar_barrier: Callable[[], None] | None = None, pp_proxy_tensors: Any = None,
    ) -> GenerationBatchResult:
        with torch.no_grad():
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                return self.forward_prefill(batch, on_publish, pp_proxy_tensors)
            if not batch.forward_mode.is_decode():
                raise NotImplementedError(f"sglang_dflash worker: forward mode {batch.forward_mode}")
            return self.forward_decode(batch, on_publish, grammar_barrier)

    def forward_prefill(
        self, batch: ScheduleBatch, on_publish: Callable[[torch.Tensor], None] | None, pp_proxy_tensors: Any
    ) -> GenerationBatchResult:
        """Target prefill (it samples the first token) capturing the drafter's layers; draft K/V for the prompt."""
        out = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.FULL
        )
        logits_output = out.logits_output
        positions = extend_positions(batch.prefix_lens, batch.extend_lens, self.device)
        self.prefill_draft(batch.reqs, logits_output.hidden_states, positions, batch.out_cache_loc,
                           batch.req_pool_indices, batch.prefix_lens)
        logits_output.hidden_states = None
        if any(has_penalties(r.sampling_params) for r in batch.reqs):
            if self.penalties is None:
                vocab = self.target_worker.model_runner.model_config.vocab_size
                self.penalties = PenaltyState(self.req_to_token_pool.req_to_token.shape[0], vocab, self.device)
            self.penalties.start(batch.reqs, out.next_token_ids)
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        out.next_draft_input = DFlashDraftInput(out.next_token_ids, batch.seq_lens, self.block_size)
        return out

    def forward_decode(
        self, batch: ScheduleBatch, on_publish: Callable[[torch.Tensor], None] | None,
        grammar_barrier: Callable[[], None] | None,
    ) -> GenerationBatchResult:
        """The shared DFlash step with SGLang's verify; every returned tensor is fresh: SGLang reads them after
        the next step has run."""
        block = self.block_size
        rpi = batch.req_pool_indices.to(torch.int64)
        prefix = batch.seq_lens.to(torch.int64)
        bonus = batch.spec_info.bonus_tokens.to(torch.int64)
        kv_bound = min(max(r.kv.kv_allocated_len for r in batch.reqs), self.req_to_token_pool.req_to_token.shape[1])
        states, plans = self.step.plan(batch.reqs, self.host_current, [block] * len(batch.reqs))
        self.verifying = (batch, grammar_barrier)
        out = self.step.decode(self, self.req_to_token_pool.req_to_token, rpi, prefix, bonus, states, plans, kv_bound)
        logits_output, can_run_cuda_graph = self.verify_output
        self.verifying = self.verify_output = None
        width = out.out_tokens.shape[1]
        if self.penalties is not None:
            self.penalties.commit(rpi, out.out_tokens, out.accept_lens + 1)
        out_tokens = out.out_tokens.clamp_min(0).flatten()  # SGLang reads the first accept_lens + 1 of each row
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        if batch.return_logprob:
            compute_spec_logprobs(batch, logits_output, out_tokens, chain_stride=width)
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens, accept_lens=(out.accept_lens + 1).to(torch.int32),
            next_draft_input=DFlashDraftInput(out.next_bonus, out.new_seq_lens, block),
            speculative_num_draft_tokens=width, new_seq_lens=out.new_seq_lens, can_run_cuda_graph=can_run_cuda_graph,
        )

    # ---- VerifyHost ----
    def verify(self, block: DraftBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's TARGET_VERIFY forward over the [bs, W] chain, then plain decoding's logit adjustments."""
        batch, grammar_barrier = self.verifying
        bs, width = block.candidates.shape
        batch.out_cache_loc = block.slots.flatten()
        verify = DFlashVerifyInput(
            draft_token=block.candidates.flatten(), positions=block.positions.flatten(), draft_token_num=width,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        forward_batch, _ = verify.prepare_for_verify(batch, self.target_worker)
        out = self.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
        logits_output = out.logits_output
        features = logits_output.hidden_states
        if features is None or features.shape[0] != bs * width:
            got = None if features is None else tuple(features.shape)
            raise RuntimeError(f"sglang_dflash: expected captured target features for {bs * width} tokens, got {got}")
        logits_output.hidden_states = None
        logits = logits_output.next_token_logits  # [bs * W, V]
        self.adjust_logits(batch, logits, block.req_pool_indices, block.candidates, block.seq_lens, grammar_barrier)
        self.verify_output = (logits_output, out.can_run_cuda_graph)
        # the features wait for the next draft forward: copied out of buffers a CUDA graph replay reuses
        return block.verified(logits.view(bs, width, -1)), block.verified(features.view(bs, width, -1)).clone()

    def sampling(self, block: DraftBlock) -> tuple[SamplingBatchInfo | None, torch.Tensor | None]:
        info = self.verifying[0].sampling_info
        if info.is_all_greedy:
            return None, None
        vocab = self.target_worker.model_runner.model_config.vocab_size
        uniforms = torch.rand(block.batch_size, block.width + 1, generator=self.generator, device=self.device)
        return sampling_batch_info(info, self.verifying[0].reqs, vocab), uniforms

    def adjust_logits(
        self, batch: ScheduleBatch, logits: torch.Tensor, rpi: torch.Tensor, candidates: torch.Tensor,
        prefix: torch.Tensor, grammar_barrier: Callable[[], None] | None,
    ) -> None:
        """In place, what plain decoding applies before sampling: custom logit processors, penalties (exact per
        row), the grammar mask over the drafted chain, logit_bias."""
        info = batch.sampling_info
        bs, block = candidates.shape
        rows = logits.view(bs, block, -1)
        if info.has_custom_logit_processor:
            apply_custom_logit_processor(logits, info, num_tokens_in_batch=block)
        if self.penalties is not None:
            self.penalties.apply(rows, batch.reqs, rpi, candidates, prefix)
        if batch.has_grammar:
            mask = build_grammar_vocab_mask(
                reqs=batch.reqs, tree=GrammarTree.from_linear_chain(candidates), sampling_info=info,
                device=logits.device, barrier=grammar_barrier,
            )
            if mask is not None:
                mask.apply(logits)
        if info.logit_bias is not None:
            rows.add_(info.logit_bias[:, None])

    def prefill_draft(self, reqs: list, features: torch.Tensor, positions: torch.Tensor,
                      out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: list[int]) -> None:
        """The requests' proposer states and the draft context K/V of these prompt tokens (`DFlashStep.prefill`)
        from the target's captured features."""
        if features is None or features.shape[0] != positions.shape[0]:
            got = None if features is None else tuple(features.shape)
            raise RuntimeError(f"sglang_dflash: expected captured target features for {positions.shape[0]} tokens, "
                               f"got {got}")
        self.step.prefill(reqs, features, positions, out_cache_loc.to(torch.int64), self.req_to_token_pool.req_to_token,
                          req_pool_indices, list(prefix_lens))
