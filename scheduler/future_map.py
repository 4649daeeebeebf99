"""FutureMap: next-step inputs that depend on a step's results, kept on the device and indexed
by request slot, so the next batch can be launched before the host has seen those results."""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, num_req_slots: int, device: torch.device):
        self.next_input_ids = torch.zeros(num_req_slots, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(num_req_slots, dtype=torch.int64, device=device)  # committed KV length

    def read(self, req_pool_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next input token, committed length) of each request."""
        return self.next_input_ids[req_pool_indices], self.seq_lens[req_pool_indices]

    def publish(self, req_pool_indices: torch.Tensor, next_input_ids: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.next_input_ids[req_pool_indices] = next_input_ids
        self.seq_lens[req_pool_indices] = seq_lens
