"""ForwardMode and ForwardBatch: what one model forward over many ragged requests needs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch

from sglang_dflash.device import upload


class ForwardMode(Enum):
    EXTEND = auto()  # prefill of new tokens after an already cached prefix (may be empty)
    DECODE = auto()  # one token per request
    TARGET_VERIFY = auto()  # a block of draft tokens per request, causal inside the block

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    """Flat token inputs of a batch plus per-request lengths.

    Every mode is an extension of each request by `extend_seq_lens[i]` tokens after
    `extend_prefix_lens[i]` cached ones; attention is causal over prefix + new tokens.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 token slots the new K/V are written to
    req_pool_indices: torch.Tensor  # [bs] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64 prefix + new tokens
    extend_seq_lens: torch.Tensor  # [bs] int64 new tokens per request
    extend_prefix_lens: torch.Tensor  # [bs] int64 cached tokens per request
    max_seq_len: int  # an upper bound of seq_lens, known on the host
    extend_seq_lens_cpu: list[int]
    logits_indices: torch.Tensor | None = None  # [n] rows of the flat batch to compute logits for
    capture_layer_ids: tuple[int, ...] | None = None  # residual stream after these layers

    @property
    def batch_size(self) -> int:
        return len(self.extend_seq_lens_cpu)

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
        logits: str = "last",
        capture_layer_ids: tuple[int, ...] | None = None,
    ) -> ForwardBatch:
        """Builds a batch from host lists. logits: 'last' (last new token per request), 'all', 'none'."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        total = sum(extend_lens)
        positions = upload(torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
        ), torch.int64, device)
        rpi, seq, ext, prefix = upload([req_pool_indices, seq_lens, extend_lens, prefix_lens], torch.int64, device)
        req_idx = torch.repeat_interleave(rpi, ext, output_size=total)
        out_cache_loc = req_to_token[req_idx, positions].to(torch.int64)
        if logits == "last":
            logits_indices = ext.cumsum(0) - 1
        elif logits == "all":
            logits_indices = torch.arange(total, device=device)
        else:
            logits_indices = None
        return cls(
            forward_mode=mode,
            input_ids=upload(input_ids, torch.int64, device),
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rpi,
            seq_lens=seq,
            extend_seq_lens=ext,
            extend_prefix_lens=prefix,
            max_seq_len=max(seq_lens),
            extend_seq_lens_cpu=list(extend_lens),
            logits_indices=logits_indices,
            capture_layer_ids=capture_layer_ids,
        )

    @classmethod
    def build_from_device(
        cls,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: list[int],
        max_seq_len: int,
        req_to_token: torch.Tensor,
        capture_layer_ids: tuple[int, ...] | None = None,
        extend_lens_device: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Decode / verify batch whose prefix lengths live on the device (FutureMap): no host sync.
        input_ids are flat [sum(extend_lens)]; logits for every row. `extend_lens_device`: the same lengths on
        the device where the caller has them (else they are uploaded, or made there for a decode batch)."""
        device = input_ids.device
        ext = extend_lens_device
        if ext is None:
            n = len(extend_lens)
            ext = (torch.ones(n, dtype=torch.int64, device=device) if max(extend_lens) == 1
                   else upload(extend_lens, torch.int64, device))
        total = sum(extend_lens)
        req_of_row = torch.repeat_interleave(torch.arange(len(extend_lens), device=device), ext, output_size=total)
        row_starts = torch.repeat_interleave(ext.cumsum(0) - ext, ext, output_size=total)
        positions = prefix_lens[req_of_row] + torch.arange(total, device=device) - row_starts
        out_cache_loc = req_to_token[req_pool_indices[req_of_row], positions].to(torch.int64)
        return cls(
            forward_mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=prefix_lens + ext,
            extend_seq_lens=ext,
            extend_prefix_lens=prefix_lens,
            max_seq_len=max_seq_len,
            extend_seq_lens_cpu=list(extend_lens),
            logits_indices=torch.arange(total, device=device),
            capture_layer_ids=capture_layer_ids,
        )
