"""DraftBlock: one decode step's padded [bs, B] block per request, and where it lives in the KV cache.

Row i holds the candidates [bonus, d1, ..., d_{b_i - 1}] of request i (b_i = block_lens[i] <= B) at
positions seq_lens[i] .. seq_lens[i] + B - 1; columns past b_i are padding and write KV slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from sglang_dflash.device import upload


@dataclass
class DraftBlock:
    req_pool_indices: torch.Tensor  # [bs] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64 committed KV length (the bonus token goes at this position)
    block_lens: torch.Tensor  # [bs] int64 tokens verified per request, 1..B
    block_lens_cpu: list[int]
    candidates: torch.Tensor  # [bs, B] int64: column 0 the bonus token, then the proposed drafts
    positions: torch.Tensor  # [bs, B] int64
    slots: torch.Tensor  # [bs, B] int64 the request's KV slots of these positions
    out_cache_loc: torch.Tensor  # [bs, B] int64 the slots inside each request's block, 0 (padding) outside
    rows: torch.Tensor  # [T] int64, T = sum(block_lens): the verified tokens' indices in the flat [bs * B] block

    @classmethod
    def build(
        cls, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        bonus: torch.Tensor, block_lens_cpu: list[int],
    ) -> DraftBlock:
        """Candidates start as [bonus, 0, ...]; the proposers fill columns 1.. afterwards."""
        block = max(block_lens_cpu)
        block_lens = upload(block_lens_cpu, torch.int64, bonus.device)
        cols = torch.arange(block, device=bonus.device)
        positions = seq_lens[:, None] + cols[None, :]
        in_block = cols[None, :] < block_lens[:, None]
        slots = req_to_token[req_pool_indices[:, None], positions.clamp(max=req_to_token.shape[1] - 1)].long()
        candidates = torch.zeros(bonus.shape[0], block, dtype=torch.int64, device=bonus.device)
        candidates[:, 0] = bonus
        return cls(req_pool_indices, seq_lens, block_lens, list(block_lens_cpu), candidates, positions, slots,
                   torch.where(in_block, slots, 0), _flat_rows(block_lens_cpu, block, bonus.device))

    def select(self, reqs: list[int]) -> DraftBlock:
        """The sub-block of the requests `reqs` (indices into this block's rows), as wide as their longest."""
        idx = upload(reqs, torch.int64, self.candidates.device)
        lens = [self.block_lens_cpu[i] for i in reqs]
        w = max(lens)
        return DraftBlock(self.req_pool_indices[idx], self.seq_lens[idx], self.block_lens[idx], lens,
                          self.candidates[idx, :w], self.positions[idx, :w], self.slots[idx, :w],
                          self.out_cache_loc[idx, :w], _flat_rows(lens, w, idx.device))

    def token_rows(self, reqs: list[int]) -> torch.Tensor:
        """The indices of the requests' verified tokens among this block's T verified tokens."""
        starts = list(accumulate(self.block_lens_cpu, initial=0))
        rows = [starts[i] + j for i in reqs for j in range(self.block_lens_cpu[i])]
        return upload(rows, torch.int64, self.candidates.device)

    @property
    def batch_size(self) -> int:
        return self.candidates.shape[0]

    @property
    def width(self) -> int:
        return self.candidates.shape[1]

    @property
    def num_tokens(self) -> int:
        """T: the verified tokens of the block."""
        return sum(self.block_lens_cpu)

    @property
    def ragged(self) -> bool:
        return min(self.block_lens_cpu) < self.width

    def verified(self, x: torch.Tensor) -> torch.Tensor:
        """[bs, B, ...] -> [T, ...]: the rows of the verified tokens, in order."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat.index_select(0, self.rows) if self.ragged else flat

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] rows of the verified tokens -> [bs, B, ...], zeros outside the blocks."""
        if not self.ragged:
            return x.view(self.batch_size, self.width, *x.shape[1:])
        out = x.new_zeros(self.batch_size * self.width, *x.shape[1:]).index_copy_(0, self.rows, x)
        return out.view(self.batch_size, self.width, *x.shape[1:])

    def committed(self, accept_lens: torch.Tensor) -> torch.Tensor:
        """[bs, B] bool: the bonus and the accepted drafts of each row."""
        cols = torch.arange(self.width, device=accept_lens.device)
        return cols[None, :] <= accept_lens[:, None]


def _flat_rows(block_lens: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Indices of the blocks' tokens in the flat [len(block_lens) * width] layout, request by request."""
    return upload([i * width + j for i, n in enumerate(block_lens) for j in range(n)], torch.int64, device)
