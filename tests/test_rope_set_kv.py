"""RoPE with the KV pool write (`kernels.rope_set_kv`): the bf16 CPU kernel against apply_rope + index_copy_ on random
queries, keys and values of odd sizes, taken as views of one qkv GEMM output (non-contiguous rows), at random positions
and slots; each token independent of its batch; bad slots fail clearly; float32 stays on torch."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.kernels.cpu_extensions import cpu_extension
from sglang_dflash.kernels.rope import rope_set_kv
from sglang_dflash.models.rotary import apply_rope, build_cos_sin_cache, rope_at, rope_table


def case(tokens: int, heads: int, kv: int, hd: int, dtype: torch.dtype, seed: int):
    """(qk, v, cos, sin, k_cache, v_cache, loc): qk and v are views of one [T, (H + KV) * hd] qkv row block."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + kv) * hd, generator=gen) * 3).to(dtype)
    qk = qkv[:, : heads * hd].view(tokens, heads, hd)
    v = qkv[:, heads * hd :].view(tokens, kv, hd)
    table = rope_table(build_cos_sin_cache(hd, 8192, 10000.0, torch.device("cpu")), dtype)
    cos, sin = rope_at(table, torch.randint(0, 8192, (tokens,), generator=gen))
    k_cache = torch.randn(3 * tokens + 7, kv, hd, generator=gen).to(dtype)
    loc = torch.randperm(3 * tokens + 6, generator=gen)[:tokens] + 1
    return qk, v, cos, sin, k_cache, k_cache.clone().neg_(), loc


def reference(qk, v, cos, sin, k_cache, v_cache, loc):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rotated = apply_rope(qk, cos, sin)
    nq = qk.shape[1] - v.shape[1]
    k_cache.index_copy_(0, loc, rotated[:, nq:])
    v_cache.index_copy_(0, loc, v)
    return rotated[:, :nq], k_cache, v_cache


@pytest.mark.parametrize("tokens,heads,kv,hd", [(1, 12, 3, 64), (7, 9, 3, 64), (33, 4, 1, 128), (130, 6, 2, 18)])
def test_bf16_matches_apply_rope_and_index_copy(tokens: int, heads: int, kv: int, hd: int):
    if cpu_extension("rope") is None:
        pytest.skip("the C++ kernel did not build here")
    qk, v, cos, sin, k_cache, v_cache, loc = case(tokens, heads, kv, hd, torch.bfloat16, tokens + hd)
    want_q, want_k, want_v = reference(qk, v, cos, sin, k_cache, v_cache, loc)
    q = rope_set_kv(qk, v, cos, sin, k_cache, v_cache, loc)
    assert torch.equal(q, want_q) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    i = tokens // 2  # one token alone: the same rows
    k_one, v_one = k_cache.clone(), v_cache.clone()
    q_one = rope_set_kv(qk[i : i + 1], v[i : i + 1], cos[i : i + 1], sin[i : i + 1], k_one, v_one, loc[i : i + 1])
    assert torch.equal(q_one, q[i : i + 1]) and torch.equal(k_one, k_cache) and torch.equal(v_one, v_cache)


def test_bad_slots_fail_and_float32_uses_torch():
    qk, v, cos, sin, k_cache, v_cache, loc = case(5, 6, 2, 32, torch.bfloat16, 0)
    if cpu_extension("rope") is not None:
        with pytest.raises(RuntimeError, match="loc must index rows"):
            rope_set_kv(qk, v, cos, sin, k_cache, v_cache, torch.full_like(loc, k_cache.shape[0]))
    qk, v, cos, sin, k_cache, v_cache, loc = case(5, 6, 2, 32, torch.float32, 1)
    want = reference(qk, v, cos, sin, k_cache, v_cache, loc)
    got_q = rope_set_kv(qk, v, cos, sin, k_cache, v_cache, loc)
    assert all(torch.equal(a, b) for a, b in zip((got_q, k_cache, v_cache), want))
