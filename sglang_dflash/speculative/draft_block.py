"""DraftBlock: one decode step's padded [bs, B] block per request, and where it lives in the KV cache.

Row i holds the candidates [bonus, d1, ..., d_{b_i - 1}] of request i (b_i = block_lens[i] <= B) at
positions seq_lens[i] .. seq_lens[i] + B - 1; columns past b_i are padding and write KV slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        block_lens = torch.tensor(block_lens_cpu, dtype=torch.int64, device=bonus.device)
        cols = torch.arange(block, device=bonus.device)
        positions = seq_lens[:, None] + cols[None, :]
        in_block = cols[None, :] < block_lens[:, None]
        slots = req_to_token[req_pool_indices[:, None], positions.clamp(max=req_to_token.shape[1] - 1)].long()
        candidates = torch.zeros(bonus.shape[0], block, dtype=torch.int64, device=bonus.device)
        candidates[:, 0] = bonus
        rows = torch.tensor([i * block + j for i, n in enumerate(block_lens_cpu) for j in range(n)], dtype=torch.int64)
        return cls(req_pool_indices, seq_lens, block_lens, list(block_lens_cpu), candidates, positions, slots,
                   torch.where(in_block, slots, 0), rows.to(bonus.device, non_blocking=True))

    @property
    def batch_size(self) -> int:
        return self.candidates.shape[0]

    @property
    def width(self) -> int:
        return self.candidates.shape[1]

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
