"""Decode attention read straight from the paged KV pool: each row is one query token attending to the first
seq_len slots of its request (`req_to_token`), without a gathered copy of K/V.

On CPU the C++ kernel `csrc/decode_attention.cpp` runs where it builds; on CUDA/XPU the Triton kernel
(`decode_attention_triton.py`) where triton imports; otherwise, or when `SGLANG_DFLASH_KERNELS=torch`, the torch
reference. `SGLANG_DFLASH_KERNELS=triton` forces the Triton kernel (on CPU tensors under TRITON_INTERPRET=1).
"""


import torch

from sglang_dflash.kernels.backend import use_triton
from sglang_dflash.kernels.cpu_extensions import cpu_kernel


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
) -> torch.Tensor:
    """Torch reference of `decode_attention` (gathers each row's K/V, pads to max_seq_len, float32 softmax)."""
    bs, nh, hd = q.shape
    nkv = k_cache.shape[1]
    max_kv = max(max_seq_len, 1)
    slots = req_to_token[req_pool_indices.long(), :max_kv].long()
    k = k_cache[slots].float().permute(0, 2, 1, 3)  # [bs, nKV, L, hd]
    v = v_cache[slots].float().permute(0, 2, 1, 3)
    qg = q.float().view(bs, nkv, nh // nkv, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [bs, nKV, g, L]
    hidden = torch.arange(max_kv, device=q.device)[None, :] >= seq_lens[:, None]
    probs = scores.masked_fill(hidden[:, None, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.matmul(probs, v).reshape(bs, nh, hd)


def reads_runs(device: torch.device) -> bool:
    """Whether `decode_attention` on this device reads K/V once for consecutive rows of one request (the C++
    kernel: a verify block's tokens as 1-token rows cost about one row's reads), not once per row."""
    return device.type == "cpu" and cpu_kernel("decode_attention") is not None


def attends_in_tiles(device: torch.device, head_dim: int) -> bool:
    """Whether the C++ kernel serves `decode_attention` here in tiles of 16 positions (AVX-512, head_dim a multiple
    of 16 up to 256): a query row then costs no more than inside CPU SDPA, so prefill chunks go as 1-token rows too
    (measured on a 2-core AVX512-BF16 CPU: bf16 prompts of 100-1,500 tokens 17-23% faster than one padded SDPA group,
    float32 within 5%)."""
    return reads_runs(device) and cpu_kernel("decode_attention").tiles(head_dim)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
) -> torch.Tensor:
    """q [bs, nH, hd] (any strides); k_cache, v_cache [slots, nKV, hd] of one layer; req_to_token [R, ctx]
    int32/int64 slot of each position; req_pool_indices, seq_lens [bs]: row i attends to positions
    [0, seq_lens[i]) of request req_pool_indices[i]; max_seq_len >= every seq_len, known on the host (no device
    sync). Returns [bs, nH, hd] float32 (a row with seq_len 0: zeros)."""
    assert q.dim() == 3 and k_cache.shape == v_cache.shape and q.shape[2] == k_cache.shape[2], (q.shape, k_cache.shape)
    assert q.shape[1] % k_cache.shape[1] == 0, (q.shape, k_cache.shape)
    assert req_pool_indices.shape == seq_lens.shape == (q.shape[0],), (req_pool_indices.shape, seq_lens.shape)
    if use_triton(q):
        from sglang_dflash.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale)
    if reads_runs(q.device):
        return cpu_kernel("decode_attention").decode_attention(q, k_cache, v_cache, req_to_token,
                                                                  req_pool_indices, seq_lens, scale)
    return decode_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale,
                                  max_seq_len)
