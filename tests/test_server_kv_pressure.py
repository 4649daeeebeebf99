"""KV pressure: with a KV pool too small for all requests at once, the newest running request is retracted
and recomputed later; every request still completes with the same output as when sent alone."""

from __future__ import annotations

import asyncio

from server_helpers import KV_PRESSURE_TOKENS, PROMPTS, alone_outputs, concurrent_chats, shared_server

NUM_REQUESTS = 8


def test_retraction_under_kv_pressure_keeps_outputs() -> None:
    alone = alone_outputs()
    server = shared_server("kv_pressure")
    prompts = PROMPTS[:NUM_REQUESTS]
    outs = asyncio.run(concurrent_chats("kv_pressure", prompts))
    for prompt, out in zip(prompts, outs):
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.content == alone[prompt], prompt
    info = server.wait_idle()
    assert info["max_total_num_tokens"] == KV_PRESSURE_TOKENS
    assert info["num_retractions"] > 0
    assert info["available_kv_tokens"] == KV_PRESSURE_TOKENS
