"""The torch attention backend against per-request softmax attention, on random paged, ragged batches that mix
1-token rows (decode) with longer ones (verify blocks, prefill chunks)."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.kernels.decode_attention import attends_in_tiles, reads_runs
from sglang_dflash.runtime import attention
from sglang_dflash.runtime.attention import TorchNativeAttnBackend
from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode

NKV, NH, HD = 2, 6, 16


def reference(q, k_cache, v_cache, req_to_token, rpi, prefix_lens, ext_lens, scale):
    """Each token attends to its request's slots 0..its own position, causally."""
    out, t = [], 0
    for r, p, e in zip(rpi.tolist(), prefix_lens, ext_lens):
        for j in range(e):
            slots = req_to_token[r, : p + j + 1]
            k = k_cache[slots].float().repeat_interleave(NH // NKV, 1)  # [L, nH, hd]
            v = v_cache[slots].float().repeat_interleave(NH // NKV, 1)
            w = torch.einsum("hd,lhd->hl", q[t].float(), k).mul(scale).softmax(-1)
            out.append(torch.einsum("hl,lhd->hd", w, v).reshape(-1))
            t += 1
    return torch.stack(out)


LAYOUTS = {"default": None, "padded": (0, 0.0), "hybrid": (0, 0.6), "single-rows": (10**9, 10.0**9), "runs": None}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_ragged_batches_match_per_request_attention(seed: int, layout: str, monkeypatch, force_kernels):
    """Whatever the layout (the longest blocks padded as one group, every other token a 1-token row): equal
    to per-request attention. "runs": the C++ decode kernel, which reads a request's consecutive rows together,
    takes every block up to SMALL_Q tokens as 1-token rows (every block where it attends in tiles); the others lay
    out by cost, decode rows in torch."""
    if layout == "runs":
        if not reads_runs(torch.device("cpu")):
            pytest.skip("no C++ decode-attention kernel here")
    else:
        force_kernels("torch")
    if LAYOUTS[layout] is not None:
        monkeypatch.setattr(attention, "GROUP_COST", dict.fromkeys((2, 4), LAYOUTS[layout][0]))
        monkeypatch.setattr(attention, "PADDED_POSITION_COST", LAYOUTS[layout][1])
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 7, (1,), generator=gen))
    mix = [[1], [1, 2, 5], [3, 8], [1, 70]][seed % 4]  # decode, mixed verify, verify, decode + a long prefill
    ext_lens = [mix[int(torch.randint(0, len(mix), (1,), generator=gen))] for _ in range(bs)]
    prefix_lens = torch.randint(0, 40, (bs,), generator=gen).tolist()
    slots = 8 * 128
    req_to_token = torch.randperm(slots, generator=gen).view(8, 128)
    rpi = torch.randperm(8, generator=gen)[:bs]
    k_cache = torch.randn(slots, NKV, HD, generator=gen)
    v_cache = torch.randn(slots, NKV, HD, generator=gen)
    fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [0] * sum(ext_lens), rpi.tolist(), prefix_lens, ext_lens,
                            req_to_token, torch.device("cpu"))
    q = torch.randn(sum(ext_lens), NH, 2 * HD, generator=gen)[:, :, ::2]  # non-contiguous
    backend = TorchNativeAttnBackend(NKV, HD)
    meta = backend.init_forward_metadata(fb, req_to_token, torch.float32)
    padded = attention.padded_rows(ext_lens, fb.max_seq_len, attention.group_cost(torch.float32))
    if layout == "runs":  # the tiled kernel takes prefill chunks as rows too
        tiles = attends_in_tiles(torch.device("cpu"), HD)
        padded = [] if tiles else [i for i, n in enumerate(ext_lens) if n > attention.SMALL_Q]
    assert len(meta.groups) == (2 if 0 < len(padded) < bs else 1)
    if layout == "single-rows":  # only prefill-long rows are padded
        assert padded == [i for i, n in enumerate(ext_lens) if n > attention.SMALL_Q]
    got = backend.forward(q, k_cache, v_cache, meta, HD**-0.5)
    want = reference(q, k_cache, v_cache, req_to_token, rpi, prefix_lens, ext_lens, HD**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_layout_pads_long_blocks_and_spreads_short_ones():
    """Measured trade-offs: a few short blocks among decode rows run as extra 1-token rows (one group); long
    blocks are padded as a group of their own; a batch of equal blocks is one padded group."""
    assert attention.padded_rows([1] * 15 + [2], 300) == []
    assert attention.padded_rows([16, 3, 2, 2] + [1] * 12, 400) == [0]
    assert attention.padded_rows([16] * 4 + [1] * 12, 300) == [0, 1, 2, 3]
    assert attention.padded_rows([16] * 16, 300) == list(range(16))
    assert attention.padded_rows([1, 70, 2], 100) == [1]  # a prefill chunk always pads (SDPA)


def test_float32_layout_pads_short_blocks_sooner():
    """A second group costs fewer K/V positions in float32 (a row moves twice the bytes): four 3-token blocks
    among 28 decode rows at ~225 positions pad there, and run as 1-token rows in bf16."""
    lens = [1] * 28 + [3] * 4
    assert attention.padded_rows(lens, 225, attention.group_cost(torch.float32)) == [28, 29, 30, 31]
    assert attention.padded_rows(lens, 225, attention.group_cost(torch.bfloat16)) == []
