"""DFlash hot-path kernels. Each dispatcher here documents and checks its arguments, then runs the Triton
version (`*_triton` module) or the torch reference (`*_torch`, exported too), see `backend.use_triton`."""

from sglang_dflash.kernels.backend import triton_available, use_triton
from sglang_dflash.kernels.draft_kv import materialize_draft_kv, materialize_draft_kv_torch
from sglang_dflash.kernels.greedy import greedy_accept, greedy_accept_torch
from sglang_dflash.kernels.sampling import sampling_accept, sampling_accept_torch
from sglang_dflash.kernels.sparse_sampling import sparse_sampling_accept, sparse_sampling_accept_torch

__all__ = [
    "greedy_accept",
    "greedy_accept_torch",
    "materialize_draft_kv",
    "materialize_draft_kv_torch",
    "sampling_accept",
    "sampling_accept_torch",
    "sparse_sampling_accept",
    "sparse_sampling_accept_torch",
    "triton_available",
    "use_triton",
]
