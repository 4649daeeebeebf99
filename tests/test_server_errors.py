"""Bad requests get a 4xx with an OpenAI-style error body, and the server keeps serving; API key checks."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import AUTH, ServerProcess, chat, shared_server

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server("dflash")


def assert_openai_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] and words.lower() in error["message"].lower(), error


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/chat/completions", {"model": "default", "max_tokens": 2}, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 5000}, "maximum context length"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, "n=2"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 2000}]}, "context length"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/completions", {"prompt": "hi " * 2000, "max_tokens": 2}, "context length"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 2}, "logprobs"),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "top_p": 0}}, "top_p"),
        ("/generate", {"text": "Hi", "sampling_params": {"no_such_param": 1}}, "no_such_param"),
        ("/generate", {"input_ids": [10**9]}, "input_ids"),
        ("/generate", {"text": []}, "empty"),
        ("/generate", {"input_ids": []}, "empty"),
        ("/generate", {"text": ["a", "b"], "rid": "x"}, "list of 2 rids"),
        ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "list of 2 rids"),
        ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "distinct"),
        ("/generate", {"text": "Hi", "sampling_params": {"speculative_num_draft_tokens": 64}}, "block size"),
    ],
)
def test_bad_request_is_400_with_openai_error(server: ServerProcess, path: str, body: dict, words: str) -> None:
    assert_openai_error(server.post(path, json=body), 400, words)


def test_invalid_json_is_400(server: ServerProcess) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [', headers=headers, timeout=60)
    assert_openai_error(r, 400, "invalid json")


def test_api_key_required_except_health(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        assert_openai_error(httpx.get(f"{server.url}/v1/models", headers=headers, timeout=60), 401, "api key")
        assert_openai_error(server.post("/v1/chat/completions", json=CHAT, headers=headers), 401, "api key")
    assert_openai_error(server.get("/no/such/route"), 404, "not found")


def test_server_keeps_serving_after_errors(server: ServerProcess) -> None:
    out = chat(server.client(), "Hi", max_tokens=3)
    assert out.usage.completion_tokens == 3
    info = server.wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
