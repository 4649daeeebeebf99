"""16 concurrent greedy requests each equal the same request sent alone, with the overlapped scheduler
loop and with the plain one (so the two loops give identical outputs)."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import MAX_TOKENS, PROMPTS, alone_outputs, shared_server


async def concurrent_chats(name: str) -> list:
    client = shared_server(name).async_client()
    calls = [
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )
        for p in PROMPTS
    ]
    return await asyncio.gather(*calls)


@pytest.mark.parametrize("name", ["dflash_plain", "dflash"])
def test_concurrent_requests_equal_alone(name: str) -> None:
    alone = alone_outputs()
    outs = asyncio.run(concurrent_chats(name))
    assert len(outs) == len(PROMPTS) == 16
    for prompt, out in zip(PROMPTS, outs):
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].message.content == alone[prompt], prompt
    info = shared_server(name).wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    assert info["disable_overlap_schedule"] == (name == "dflash_plain")
