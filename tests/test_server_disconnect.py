"""A client that disconnects mid-stream: its request is aborted and its KV freed at once, and the
requests running beside it are unaffected."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_helpers import AUTH, PROMPTS, alone_outputs, chat, shared_server

VICTIM_TOKENS = 400  # far more than the others: still running when they end, unless it was aborted


def test_disconnect_frees_kv_and_spares_others() -> None:
    alone = alone_outputs()
    server = shared_server("dflash")
    client = server.client()
    others = PROMPTS[:3]
    results: dict[str, str] = {}

    def run_other(prompt: str) -> None:
        results[prompt] = chat(client, prompt).choices[0].message.content

    body = {"model": "default", "messages": [{"role": "user", "content": PROMPTS[5]}], "max_tokens": VICTIM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["object"] == "chat.completion.chunk"
        threads = [threading.Thread(target=run_other, args=(p,)) for p in others]
        for t in threads:
            t.start()
        for _ in range(3):
            next(lines)
    # the stream is closed: the server sees the disconnect and aborts the request
    for t in threads:
        t.join()
    assert results == {p: alone[p] for p in others}
    info = server.wait_idle(timeout=5)
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    aborted = [line for line in server.get("/metrics").text.splitlines()
               if line.startswith("sglang:num_aborted_requests_total")]
    assert float(aborted[0].split()[-1]) >= 1


def test_non_streaming_client_that_gives_up_is_aborted() -> None:
    server = shared_server("dflash")
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPTS[6]}], "max_tokens": VICTIM_TOKENS,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=3)
    info = server.wait_idle(timeout=5)  # the server polls for disconnects every second
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
