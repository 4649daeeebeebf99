"""A hand-written corpus of malformed requests: each gets a 400 with an OpenAI-style error naming the problem
(never a 5xx), over one keep-alive connection that keeps serving; then a normal request is served and every
KV slot is free."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import AUTH, ServerProcess, shared_server

MSG = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "default", "messages": MSG, "max_tokens": 2}
COMP = {"model": "default", "prompt": "Hi", "max_tokens": 2}
GEN = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
NAN, INF = float("nan"), float("inf")


def chat(**kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {**CHAT, **kw}


def comp(**kw) -> tuple[str, dict]:
    return "/v1/completions", {**COMP, **kw}


def gen(**params) -> tuple[str, dict]:
    return "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **params}}


CASES = [  # (path, body), words the error message must contain
    (chat(temperature=NAN), "temperature"),
    (chat(temperature=INF), "temperature"),
    (chat(temperature=5e-324), "temperature"),
    (chat(temperature=1e6), "temperature"),
    (chat(temperature="0.5"), "temperature"),
    (chat(top_k=2**63), "top_k"),
    (chat(top_k=10**6), "top_k"),
    (chat(top_k=0), "top_k"),
    (chat(top_p=NAN), "top_p"),
    (chat(top_p=0), "top_p"),
    (chat(min_p=-0.1), "min_p"),
    (chat(repetition_penalty=NAN), "repetition_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(frequency_penalty=3), "frequency_penalty"),
    (chat(presence_penalty=-INF), "presence_penalty"),
    (chat(seed=2**64), "seed"),
    (chat(seed=-1), "seed"),
    (chat(seed=1.5), "seed"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_tokens="8"), "max_tokens"),
    (chat(ignore_eos="x"), "ignore_eos"),
    (chat(stream="yes"), "stream"),
    (chat(logit_bias={"50256": -100}), "logit_bias"),
    (chat(stop_token_ids=[10**9]), "stop_token_ids"),
    (chat(messages=[{"role": "user", "content": "a\ud800b"}]), "surrogate"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (chat(messages="hi"), "messages"),
    (chat(max_tokens=10**9), "context length"),
    (comp(prompt="a\udfffb"), "surrogate"),
    (comp(prompt=[True, False]), "prompt"),
    (comp(prompt=[]), "prompt"),
    (comp(prompt=[[1, 2], [3]]), "one prompt"),
    (comp(logit_bias={"1": 5}), "logit_bias"),
    (comp(top_k=-2), "top_k"),
    (comp(n="2"), "n"),
    (gen(top_p="x"), "top_p"),
    (gen(top_p=None), "top_p"),
    (gen(repetition_penalty="1.1"), "repetition_penalty"),
    (gen(min_p="0.1"), "min_p"),
    (gen(frequency_penalty="0.5"), "frequency_penalty"),
    (gen(top_k=2**63), "top_k"),
    (gen(ignore_eos="x"), "ignore_eos"),
    (gen(max_new_tokens=None), "max_new_tokens"),
    (gen(stop=[1, 2]), "stop"),
    (gen(seed=2**64), "seed"),
    (gen(logit_bias={"1": 1.0}), "logit_bias"),
    (("/generate", {"input_ids": [True, False], "sampling_params": {"max_new_tokens": 2}}), "input_ids"),
    (("/generate", {"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}}), "input_ids"),
    (("/generate", {"text": "a\ud800", "sampling_params": {"max_new_tokens": 2}}), "surrogate"),
    (("/generate", {"text": 5}), "text"),
    (("/generate", {"text": "Hi", "sampling_params": "fast"}), "sampling_params"),
    (("/generate", {"text": "Hi", "stream": 1}), "stream"),
    (("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e400}'),
     "temperature"),
    (("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}],'), "invalid json"),
]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server("dflash")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.mark.parametrize("case, words", CASES, ids=[f"{c[0]}-{i}" for i, (c, _) in enumerate(CASES)])
def test_malformed_request_is_400(client: httpx.Client, case: tuple[str, dict], words: str) -> None:
    path, body = case
    raw = body if isinstance(body, str) else json.dumps(body)  # NaN, Infinity and "\ud800" as json writes them
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and words.lower() in error["message"].lower(), error
    ok = client.post("/generate", json=GEN)  # the same keep-alive connection still serves
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2, ok.text


def test_server_healthy_after_the_corpus(server: ServerProcess) -> None:
    r = server.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    info = server.wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
