"""DFlash hot-path kernels: each has a torch reference (`*_torch`), a Triton version
(`*_triton`, in the matching `*_triton` module) and the dispatching name exported here."""

from sglang_dflash.kernels.backend import triton_available, use_triton
from sglang_dflash.kernels.draft_block import prepare_draft_block, prepare_draft_block_torch
from sglang_dflash.kernels.draft_kv import materialize_draft_kv, materialize_draft_kv_torch
from sglang_dflash.kernels.greedy import greedy_accept, greedy_accept_torch
from sglang_dflash.kernels.sampling import sampling_accept, sampling_accept_torch

__all__ = [
    "greedy_accept",
    "greedy_accept_torch",
    "materialize_draft_kv",
    "materialize_draft_kv_torch",
    "prepare_draft_block",
    "prepare_draft_block_torch",
    "sampling_accept",
    "sampling_accept_torch",
    "triton_available",
    "use_triton",
]
