"""ModelRunner: the target model on a device, its KV pools, and one forward per ForwardBatch."""

from __future__ import annotations

import logging
import time

import torch

from sglang_dflash.device import memory_info
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.llama import CausalLM, LogitsOutput
from sglang_dflash.models.model_store import load_model_config, load_weights, resolve_model_dir
from sglang_dflash.models.packed_linear import can_pack, pack_linears
from sglang_dflash.runtime.attention import TorchNativeAttnBackend
from sglang_dflash.runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CPU_KV_TOKENS = 32768  # the KV pool on cpu unless max_total_tokens or mem_fraction_static says otherwise
DEVICE_MEM_FRACTION = 0.85  # mem_fraction_static on cuda / xpu unless given


def kv_pool_tokens(free: int, total: int, fraction: float, bytes_per_token: int, reserved: int = 0) -> int:
    """KV slots that fit when weights + KV pools may take `fraction` of `total` memory, `free` bytes measured
    after the weights and `reserved` more still to come (SGLang's mem_fraction_static; the rest of the memory is
    left to activations)."""
    budget = free - total * (1 - fraction) - reserved
    tokens = int(budget // bytes_per_token)
    if tokens < 1:
        raise ValueError(f"mem_fraction_static {fraction} leaves no memory for the KV cache ({free / 2**30:.1f} "
                         f"of {total / 2**30:.1f} GiB free after the weights): raise it or set max_total_tokens")
    return tokens


class ModelRunner:
    def __init__(
        self,
        model_path: str | None,
        device: torch.device,
        dtype: torch.dtype,
        max_total_tokens: int | None,
        max_running_requests: int,
        context_length: int | None = None,
        tokens_past_committed: int = 1,
        mem_fraction_static: float | None = None,
        extra_kv_bytes_per_token: int = 0,
        reserved_bytes: int = 0,
        batch_invariant: bool = False,
    ):
        """tokens_past_committed: positions a decode step may touch from a request's committed length on (1
        for plain decoding; 2 speculative blocks + 1: the block in flight and the next); req_to_token rows
        are that much wider than the context and the context shrinks to keep positions in the rope table.
        max_total_tokens None: CPU_KV_TOKENS on cpu, else as many as mem_fraction_static leaves room for, with
        `extra_kv_bytes_per_token` (a draft pool sharing the slots) and `reserved_bytes` (weights still to load).
        batch_invariant: linears whose rows do not depend on the batch (see models/packed_linear.py)."""
        t0 = time.perf_counter()
        self.device = device
        self.dtype = dtype
        self.model_dir = resolve_model_dir(model_path)
        self.model_config: ModelConfig = load_model_config(self.model_dir)
        cfg = self.model_config
        limit = cfg.max_position_embeddings - (tokens_past_committed - 1)
        self.context_length = min(context_length or limit, limit)
        with torch.device("meta"):
            model = CausalLM(cfg).to(dtype)
        model = model.to_empty(device=device)  # in the target dtype: no float32 copy of the weights on the device
        model.tie_weights()
        model.load_weights(load_weights(self.model_dir))
        model.init_rope(device)
        model.eval().requires_grad_(False)
        if can_pack(device, dtype):
            pack_linears(model, keep_weight=("lm_head",), batch_invariant=batch_invariant)
        self.model = model
        if max_total_tokens is None:
            max_total_tokens = CPU_KV_TOKENS
            if device.type != "cpu" or mem_fraction_static is not None:
                per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
                free, total = memory_info(device)
                max_total_tokens = kv_pool_tokens(free, total, mem_fraction_static or DEVICE_MEM_FRACTION,
                                                  per_token + extra_kv_bytes_per_token, reserved_bytes)
        self.max_total_tokens = max_total_tokens
        width = self.context_length + tokens_past_committed
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, width, device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, device)
        self.token_to_kv_pool = MHATokenToKVPool(
            max_total_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, device
        )
        self.attn_backend = TorchNativeAttnBackend(cfg.num_key_value_heads, cfg.head_dim)
        logger.info("loaded %s (%s) in %.2fs", self.model_dir, cfg.architecture, time.perf_counter() - t0)

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        meta = self.attn_backend.init_forward_metadata(fb, self.req_to_token_pool.req_to_token, self.dtype)
        return self.model(fb, self.token_to_kv_pool, self.attn_backend, meta)
