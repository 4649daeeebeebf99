"""--request-timeout-s on a real server: a request unfinished when its deadline passes is aborted (its KV
freed) and ends with a 504 (non-streaming) or an error event and [DONE] (streaming); short requests served
meanwhile finish exactly as alone; time spent queued counts towards the deadline."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_helpers import AUTH, PROMPTS, ServerProcess, chat

from sglang_dflash.launch_server import parse_args

TIMEOUT_S = 3.0
LONG = 900  # tokens: far more than a CPU decodes in TIMEOUT_S
SHORT = 6
RUNNING = 3


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    s = ServerProcess(["--speculative-algorithm", "NONE", "--dtype", "float32", "--max-total-tokens", "4096",
                       "--context-length", "1024", "--max-running-requests", str(RUNNING),
                       "--request-timeout-s", str(TIMEOUT_S)]).wait_ready()
    yield s
    s.stop()


def long_chat(server: ServerProcess, out: list) -> None:
    """A non-streaming chat of LONG tokens; appends (the error it raised, seconds it took)."""
    start = time.perf_counter()
    try:
        chat(server.client(), "Tell me a story.", max_tokens=LONG)
        out.append((None, time.perf_counter() - start))
    except openai.APIStatusError as e:
        out.append((e, time.perf_counter() - start))


def long_stream(server: ServerProcess, out: list) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        out.append([line[6:] for line in r.iter_lines() if line.startswith("data: ")])


def wait_running(server: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 30
    while server.info()["num_running_reqs"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def assert_timed_out(result: tuple, slack_s: float = 2.0) -> None:
    error, elapsed = result
    assert error is not None and error.status_code == 504, result
    body = error.response.json()["error"]
    assert body["type"] == "TimeoutError" and "--request-timeout-s" in body["message"], body
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + slack_s, elapsed


def test_flag_is_checked() -> None:
    assert parse_args([]).request_timeout_s is None
    with pytest.raises(SystemExit):
        parse_args(["--request-timeout-s", "0"])


def test_long_requests_time_out_and_short_ones_are_unaffected(server: ServerProcess) -> None:
    client = server.client()
    prompts = PROMPTS[:3]
    alone = [chat(client, p, max_tokens=SHORT).choices[0].message.content for p in prompts]
    plain, streams = [], []
    jobs = [threading.Thread(target=long_chat, args=(server, plain)),
            threading.Thread(target=long_stream, args=(server, streams))]
    for t in jobs:
        t.start()
    wait_running(server, 2)
    served = [chat(client, p, max_tokens=SHORT).choices[0].message.content for p in prompts]  # one slot left
    for t in jobs:
        t.join(30)
    assert served == alone
    assert_timed_out(plain[0])
    events = streams[0]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504, events[-3:]
    assert any(json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]), "no token streamed"
    info = server.wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]


def test_time_queued_counts(server: ServerProcess) -> None:
    """With every slot taken by long requests, one more waits in the queue: its deadline runs from its
    arrival, so it ends about TIMEOUT_S after it was sent although it ran for only a fraction of that."""
    results: list = []
    jobs = [threading.Thread(target=long_chat, args=(server, results)) for _ in range(RUNNING)]
    for t in jobs:
        t.start()
    wait_running(server, RUNNING)
    queued: list = []
    long_chat(server, queued)
    for t in jobs:
        t.join(30)
    assert_timed_out(queued[0], slack_s=1.5)
    for r in results:
        assert_timed_out(r)
    info = server.wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    assert chat(server.client(), PROMPTS[0], max_tokens=SHORT).choices[0].finish_reason == "length"
