"""Req (one generation request and its bookkeeping) and ScheduleBatch (what one step runs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang_dflash.device import HostCopy
from sglang_dflash.runtime.forward_batch import ForwardMode
from sglang_dflash.runtime.tokenizer import IncrementalDetokenizer
from sglang_dflash.sampling.sampling_params import SamplingParams


class Req:
    """A request. Invariant while decoding: KV holds fill_ids[:-1]; fill_ids[-1] is the next input."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: set[int],
        context_length: int,
    ):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.detokenizer = detokenizer
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= eos_token_ids
        self.context_length = context_length
        self.finished_reason: dict | None = None
        self.req_pool_idx: int | None = None
        self.kv_committed_len = 0  # tokens whose KV is in the cache
        self.kv_allocated_len = 0  # slots reserved in req_to_token row
        self.prefix_node = None  # the radix cache node this request locks: its row's first cached_len slots
        self.cached_len = 0  # leading slots of the row owned by the radix cache (the rest are the request's)
        self.cached_tokens = 0  # prompt tokens served by the radix cache at (first) admission
        seed = sampling_params.seed if sampling_params.seed is not None else torch.seed()
        self.generator = torch.Generator().manual_seed(seed)
        self.created_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.sent_text_len = 0  # text and ids already handed out (streaming)
        self.sent_ids = 0
        self.spec_verify_ct = 0
        self.spec_accepted_drafts = 0
        self.spec_draft_slots = 0
        self.spec_histogram: list[int] = []  # [k] = verify steps that committed k + 1 tokens
        self.spec_block_histogram: list[int] = []  # [b - 1] = verify steps with a block of b tokens
        self.spec_sources: dict[str, int] = {}  # verify steps per proposal source (dflash, lookup, none)
        self.spec_state = None  # the speculative worker's per-request proposer state
        self.retracted_count = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def append_token(self, token: int) -> None:
        """Adds one generated token and checks the stop conditions in SGLang's order."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token)
        delta = self.detokenizer.append([token])
        params = self.sampling_params
        if token in self.stop_token_ids:
            self.finish({"type": "stop", "matched": token})
        elif len(self.output_ids) >= params.max_new_tokens:
            self.finish({"type": "length", "length": params.max_new_tokens})
        elif self.seq_len >= self.context_length:
            self.finish({"type": "length", "length": len(self.output_ids)})
        if params.stop and delta:
            text = self.detokenizer.text
            window = text[max(0, len(text) - len(delta) - max(map(len, params.stop)) + 1) :]
            hits = [(window.find(s), s) for s in params.stop if s in window]
            if hits:
                pos, s = min(hits)
                self.detokenizer.text = text[: len(text) - len(window) + pos]
                self.finished_reason = {"type": "stop", "matched": s}
                self.finished_time = time.perf_counter()

    def finish(self, reason: dict) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.finished_time = time.perf_counter()

    def streamable_text(self) -> str:
        """Text safe to stream so far: holds back a tail that could still become a stop string."""
        text = self.detokenizer.text
        if self.finished() or not self.sampling_params.stop:
            return text
        hold = max(map(len, self.sampling_params.stop)) - 1
        return text[: max(self.sent_text_len, len(text) - hold)]

    def take_delta(self) -> tuple[str, list[int]] | None:
        """The streamable text and the ids new since the last call; None when there is nothing to send."""
        text = self.streamable_text()
        delta = text[self.sent_text_len :]
        self.sent_text_len = max(self.sent_text_len, len(text))
        ids = self.output_ids[self.sent_ids :]
        self.sent_ids = len(self.output_ids)
        if not (delta or ids or self.finished()):
            return None
        return delta, ids

    def meta_info(self) -> dict:
        end = self.finished_time or time.perf_counter()
        info = {
            "id": self.rid,
            "prompt_tokens": len(self.origin_input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
            "e2e_latency": end - self.created_time,
        }
        if self.spec_verify_ct:
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = (self.spec_accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct
            info["spec_accept_rate"] = self.spec_accepted_drafts / max(self.spec_draft_slots, 1)
            info["spec_accept_histogram"] = list(self.spec_histogram)
            info["spec_block_histogram"] = list(self.spec_block_histogram)
            info["spec_source_steps"] = dict(self.spec_sources)
        return info


@dataclass
class ScheduleBatch:
    """The requests of one step and the host-side lengths the worker turns into a ForwardBatch."""

    reqs: list[Req]
    forward_mode: ForwardMode
    prefix_lens: list[int] = field(default_factory=list)  # EXTEND: cached tokens per request
    extend_lens: list[int] = field(default_factory=list)  # EXTEND: new tokens per request
    # Snapshots taken when the batch is scheduled: with overlap, the host goes on to process the previous
    # batch (and may release its finished requests) while this one is still waiting for the device.
    req_pool_indices: list[int] = field(init=False)
    kv_bound: int = field(init=False)  # max slots allocated to a request: bounds every sequence length
    input_ids: list[int] = field(init=False)  # EXTEND: the new tokens, flat
    sample_rows: list[int] = field(init=False)  # requests that get a next token from this step
    host_current: bool = True  # the requests' host state includes every earlier step (no batch in flight)

    def __post_init__(self) -> None:
        self.req_pool_indices = [r.req_pool_idx for r in self.reqs]
        self.kv_bound = max((r.kv_allocated_len for r in self.reqs), default=0)
        self.input_ids = []
        if not self.forward_mode.is_extend():
            self.sample_rows = list(range(len(self.reqs)))
            return
        self.sample_rows = []
        for i, (r, p, e) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens)):
            self.input_ids.extend(r.fill_ids[p : p + e])
            if p + e == r.seq_len:
                self.sample_rows.append(i)

    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class GenerationBatchResult:
    """What one step produced, still on the device (resolved by the scheduler when it processes it).

    out_tokens [bs, W]: per request the committed new tokens, -1 padded (AR: W = 1; a prefill chunk
    that does not finish the prompt gets -1). Speculative steps add accept_lens [bs] and block sizes.
    """

    out_tokens: torch.Tensor
    accept_lens: torch.Tensor | None = None
    block_sizes: list[int] | None = None
    plans: list | None = None  # the speculative plan of each request (source, block length)
    host_tokens: HostCopy = field(init=False)  # out_tokens on their way to the host, started with the step

    def __post_init__(self) -> None:
        self.host_tokens = HostCopy(self.out_tokens)

    def resolve(self) -> tuple[list[list[int]], list[int] | None]:
        """(tokens per request, accepted drafts per request) on the host: the one sync point (a speculative row
        holds its accepted drafts and the next bonus, so the accepted count is its token count - 1)."""
        rows = self.host_tokens.wait().tolist()
        tokens = [[t for t in row if t >= 0] for row in rows]
        return tokens, None if self.accept_lens is None else [len(t) - 1 for t in tokens]
