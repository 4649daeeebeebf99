"""The HTTP API with the real openai client: chat and completions (streaming and not), usage, stop strings,
SGLang's /generate with spec metrics, and the service endpoints. A DFLASH server with a random drafter."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import API_KEY, ServerProcess, chat, shared_server

from sglang_dflash.models.model_store import resolve_model_dir
from sglang_dflash.runtime.tokenizer import apply_chat_template, load_tokenizer

PROMPT = "Write a haiku about autumn."


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server("dflash")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def chat_prompt_tokens() -> int:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    return len(apply_chat_template(tokenizer, [{"role": "user", "content": PROMPT}]))


def test_chat_stream_and_not_agree_with_right_usage(client: openai.OpenAI, chat_prompt_tokens: int) -> None:
    full = chat(client, PROMPT, max_tokens=8)
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (chat_prompt_tokens, 8)
    assert full.usage.total_tokens == chat_prompt_tokens + 8

    chunks = list(chat(client, PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_not(client: openai.OpenAI, server: ServerProcess) -> None:
    ids = server.post("/generate", json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 1}})
    prompt_len = ids.json()["meta_info"]["prompt_tokens"]
    kw = dict(model="default", prompt="The capital of France is", max_tokens=6, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].text
    assert full.usage.prompt_tokens == prompt_len and 1 <= full.usage.completion_tokens <= 6
    assert full.usage.total_tokens == prompt_len + full.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_strings(client: openai.OpenAI) -> None:
    reference = chat(client, PROMPT).choices[0].message.content
    words = reference.split()
    assert len(words) >= 3, reference
    stop = words[2]
    expected = reference[: reference.index(stop)]
    out = chat(client, PROMPT, stop=[stop, "no such stop string"])
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = chat(client, PROMPT, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_generate_native_with_spec_metrics(server: ServerProcess) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True}}
    out = server.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 6 and out["text"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["spec_accept_length"] >= 1 and meta["spec_verify_ct"] >= 1
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert sum(meta["spec_block_histogram"]) == sum(meta["spec_source_steps"].values()) == meta["spec_verify_ct"]

    events = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = httpx.Response(200, content=events[-2]).json()
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]

    by_ids = server.post("/generate", json={"input_ids": out["output_ids"], "sampling_params": {"max_new_tokens": 2}})
    assert by_ids.status_code == 200 and by_ids.json()["meta_info"]["prompt_tokens"] == 6

    batch = server.post("/generate", json={"text": ["Hi", "Hello there"], "rid": ["first", "second"],
                                           "sampling_params": {"max_new_tokens": 2}})
    assert batch.status_code == 200 and [o["meta_info"]["id"] for o in batch.json()] == ["first", "second"]


def test_service_endpoints(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    assert server.get("/health_generate").status_code == 200
    assert server.get("/flush_cache").status_code == 200
    info = server.wait_idle()
    assert info["speculative_algorithm"] == "DFLASH" and info["context_length"] == 1024
    assert info["available_kv_tokens"] == info["max_total_num_tokens"] == 4096
    assert "api_key" not in info
    metrics = server.get("/metrics").text
    for name in ("sglang:num_requests_total", "sglang:generation_tokens_total", "sglang:time_to_first_token_seconds",
                 "sglang:time_per_output_token_seconds", "sglang:e2e_request_latency_seconds",
                 "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:spec_accept_length{", "sglang:spec_accept_length_per_request_bucket",
                 "sglang:spec_verify_steps_by_source_total{", "sglang:spec_verify_steps_by_block_size_total{"):
        assert name in metrics, name
