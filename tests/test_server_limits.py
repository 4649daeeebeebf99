"""Bounded work and graceful shutdown, on real servers: a fresh server's info (resolved dtype, a full KV pool),
the request body limit (413 at once, the event loop free meanwhile), the admission bound (503 + Retry-After),
and SIGTERM under load (short requests finish, long ones end with an error event / a 503 body, exit 0)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_helpers import AUTH, ServerProcess

GRACE_S = 3
BODY_MB = 1
LONG = 900  # tokens: far more than a CPU decodes in the grace period
COMMON = ["--speculative-algorithm", "NONE", "--dtype", "float32", "--max-total-tokens", "4096",
          "--context-length", "1024"]


def chat_body(max_tokens: int, stream: bool = False) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    s = ServerProcess([*COMMON, "--max-running-requests", "1", "--max-queued-requests", "1",
                       "--max-request-body-mb", str(BODY_MB)]).wait_ready()
    yield s
    s.stop()


def test_fresh_server_info(server: ServerProcess) -> None:
    info = server.info()  # before any request
    assert info["dtype"] == "float32"
    assert info["available_kv_tokens"] == info["max_total_num_tokens"] == 4096
    assert info["max_queued_requests"] == 1 and info["shutdown_grace_s"] == 10


def test_body_over_the_limit_is_413_at_once(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "x " * (3 * 2**20), "max_tokens": 1}).encode()  # 6 MiB
    headers = {**AUTH, "Content-Type": "application/json"}
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60)
    elapsed = time.perf_counter() - start
    assert r.status_code == 413 and "--max-request-body-mb" in r.json()["error"]["message"], r.text
    assert elapsed < 2.0, elapsed

    def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
        for _ in range(2 * BODY_MB * 16):
            yield b" " * 2**16

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413, r.text
    assert server.get("/health").status_code == 200


def test_admission_bound_is_503_with_retry_after(server: ServerProcess) -> None:
    results = []

    def long_request() -> None:
        results.append(server.post("/v1/chat/completions", json=chat_body(48)))

    threads = [threading.Thread(target=long_request) for _ in range(2)]  # 1 running + 1 queued
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.info()["num_running_reqs"] + server.info()["num_waiting_reqs"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.perf_counter()
    r = server.post("/v1/chat/completions", json=chat_body(4))
    assert time.perf_counter() - start < 2.0
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "busy" in r.json()["error"]["message"]
    for t in threads:
        t.join()
    assert [x.status_code for x in results] == [200, 200]
    assert server.post("/v1/chat/completions", json=chat_body(4)).status_code == 200


def read_stream(url: str, body: dict, out: list) -> None:
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out.append(events)


def test_sigterm_finishes_short_requests_and_ends_long_ones_with_an_error() -> None:
    server = ServerProcess([*COMMON, "--shutdown-grace-s", str(GRACE_S)]).wait_ready()
    try:
        short, long_plain, streams = [], [], []
        jobs = [threading.Thread(target=lambda: short.append(server.post("/v1/chat/completions",
                                                                         json=chat_body(4))))
                for _ in range(2)]
        jobs += [threading.Thread(target=lambda: long_plain.append(server.post("/v1/chat/completions",
                                                                               json=chat_body(LONG))))]
        jobs += [threading.Thread(target=read_stream, args=(server.url, chat_body(LONG, True), streams))
                 for _ in range(2)]
        for t in jobs:
            t.start()
        deadline = time.monotonic() + 30
        while server.info()["num_running_reqs"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(GRACE_S + 20) == 0, server.log_tail()
        exit_s = time.perf_counter() - start
        for t in jobs:
            t.join(30)
        assert [r.status_code for r in short] == [200, 200]
        assert len(long_plain) == 1 and long_plain[0].status_code == 503, long_plain
        assert "shut down" in long_plain[0].json()["error"]["message"]
        assert len(streams) == 2
        for events in streams:
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-3:]
        assert GRACE_S - 0.5 < exit_s < GRACE_S + 10, exit_s
        print(f"SIGTERM -> exit 0 in {exit_s:.2f}s (grace {GRACE_S}s)")
    finally:
        server.stop()
