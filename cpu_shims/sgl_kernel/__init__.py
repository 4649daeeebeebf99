"""Pure-torch stand-in for the ``sgl_kernel`` CPU operators that SGLang 0.5.23 imports on a CPU without AMX.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports these names at module level
(``sglang.srt.mem_cache.allocation``, ``sglang.kernels.ops.kvcache.cache_move``
and ``sglang.kernels.ops.speculative.{eagle,multi_layer_eagle,cache_locs,spec_tree}``).
No CPU build of the kernel package exists on PyPI, so this package provides
them in plain torch. It deliberately registers nothing under
``torch.ops.sgl_kernel``: SGLang probes ``torch.ops.sgl_kernel.convert_weight_packed``
to decide whether the AMX backend is present, and must keep answering no, so
every layer runs its ``forward_native`` path.

Not provided: ``sgl_kernel.mamba`` (hybrid linear-attention models also need
``torch.ops.sgl_kernel`` operators at import time) and all CUDA/XPU/MUSA names.
"""

from __future__ import annotations

from sgl_kernel.memory import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
from sgl_kernel.speculative import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+sglang-dflash-cpu-shim"

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]
