"""Schemathesis against the server's own OpenAPI schema (FastAPI's /openapi.json): every operation gets its
schema examples, the negative coverage cases (each field wrong-typed or missing, unexpected methods) and
fuzzed cases, valid and invalid, with a fixed seed and bounded examples, on a real server in the GPU default
configuration (DFLASH, overlap loop). No response may be a 5xx, the server must stay healthy after every
case, and at the end a normal request is served and every KV slot is free.

Generation stays short: a 40-token context bounds requests without max_tokens, and a positive max_tokens
(max_completion_tokens, max_new_tokens) above MAX_TOKENS is lowered to it before the case is sent."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from server_helpers import AUTH, ServerProcess, dflash_args

SEED = 20240601
MAX_EXAMPLES = 10  # fuzzed cases per operation, on top of the examples and coverage cases
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    # fixed blocks: the adaptive policy's start-up calibration does not fit a 40-token context
    s = ServerProcess(dflash_args(512, "--context-length", "40", "--enable-overlap-schedule",
                                  "--no-speculative-adaptive")).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES},
        "phases": {"stateful": {"enabled": False}, "coverage": {"generation": {"mode": "negative"}}},
    })
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH, timeout=30, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


def shorten(body: object) -> None:
    """Lowers every positive integer token budget in a JSON body (nested: /generate's sampling_params)."""
    if isinstance(body, list):
        for item in body:
            shorten(item)
    elif isinstance(body, dict):
        for key, value in body.items():
            if key in TOKEN_FIELDS and type(value) is int and value > MAX_TOKENS:
                body[key] = MAX_TOKENS
            else:
                shorten(value)


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
def test_no_server_error(case: schemathesis.Case, server: ServerProcess) -> None:
    shorten(case.body)
    response = case.call(base_url=server.url, headers=AUTH, timeout=60)
    assert response.status_code < 500, f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, case.as_curl_command()


def test_server_serves_after_the_fuzzing(server: ServerProcess) -> None:
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    info = server.wait_idle()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]
