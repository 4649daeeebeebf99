"""16 concurrent greedy requests each equal the same request sent alone, with the overlapped scheduler
loop and with the plain one (so the two loops give identical outputs)."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import MAX_TOKENS, PROMPTS, alone_outputs, concurrent_chats, shared_server


@pytest.mark.parametrize("name", ["dflash_plain", "dflash"])
def test_concurrent_requests_equal_alone(name: str) -> None:
    alone = alone_outputs()
    outs = asyncio.run(concurrent_chats(name, PROMPTS))
    assert len(outs) == len(PROMPTS) == 16
    for prompt, out in zip(PROMPTS, outs):
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].message.content == alone[prompt], prompt
    info = shared_server(name).wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    assert info["disable_overlap_schedule"] == (name == "dflash_plain")
