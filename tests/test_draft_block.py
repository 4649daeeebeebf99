"""DraftBlock's two layouts of a step's verified tokens: padded [bs, B] and flat [T], on random ragged blocks; the
greedy accept of a block of plain rows."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.kernels import greedy_accept
from sglang_dflash.speculative.accept import accept
from sglang_dflash.speculative.draft_block import DraftBlock


@pytest.mark.parametrize("seed", range(4))
def test_verified_and_padded_are_inverse_on_the_blocks(seed: int):
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 7, (1,), generator=gen))
    lens = torch.randint(1, 9, (bs,), generator=gen).tolist()
    if seed == 0:
        lens = [max(lens)] * bs  # not ragged: plain views
    req_to_token = torch.randperm(8 * 128, generator=gen).view(8, 128)
    rpi = torch.randperm(8, generator=gen)[:bs]
    seq_lens = torch.randint(0, 100, (bs,), generator=gen)
    block = DraftBlock.build(req_to_token, rpi, seq_lens, torch.randint(0, 50, (bs,), generator=gen), lens)
    inside = torch.arange(block.width)[None, :] < torch.tensor(lens)[:, None]
    x = torch.randn(bs, block.width, 3, generator=gen)[:, :, ::2]  # non-contiguous
    flat = block.verified(x)
    assert torch.equal(flat, x[inside]) and flat.shape[0] == sum(lens)
    back = block.padded(flat.contiguous())
    assert torch.equal(back[inside], x[inside]) and not back[~inside].any()
    assert torch.equal(block.verified(block.out_cache_loc), req_to_token[rpi[:, None], block.positions][inside])


def test_greedy_accept_of_plain_rows_matches_the_block_kernel():
    """A step of plain decode rows only (width 1) takes the next bonus straight from the argmax: the same outputs
    as the greedy block kernel."""
    gen = torch.Generator().manual_seed(5)
    bs = 6
    req_to_token = torch.randperm(8 * 64, generator=gen).view(8, 64)
    block = DraftBlock.build(req_to_token, torch.randperm(8, generator=gen)[:bs], torch.randint(0, 50, (bs,)),
                             torch.randint(0, 90, (bs,), generator=gen), [1] * bs)
    logits = torch.randn(bs, 90, generator=gen)
    got = accept(block, logits, None, None)
    want = greedy_accept(block.candidates, block.padded(logits.argmax(-1)), block.block_lens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
