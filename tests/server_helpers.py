"""Real sglang-dflash servers for the server tests: subprocesses on free ports of 127.0.0.1, started once per
session (shared by the test modules) and killed with their process group at exit. DFLASH servers use a
randomly initialised drafter; greedy outputs of requests sent alone are computed once and shared."""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_TIMEOUT_S = 300
MAX_TOKENS = 8  # tokens per request in the equality tests (ignore_eos, greedy)

PROMPTS = [
    "Write a haiku about autumn.",
    "Explain how a hash map works.",
    "What causes the seasons on Earth?",
    "Give me a recipe for tomato soup.",
    "Describe the water cycle to a child.",
    "List three tips for clear writing.",
    "What is a list in Python?",
    "How do vaccines work?",
    "Summarise Romeo and Juliet.",
    "What is recursion?",
    "Name three prime numbers.",
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "What does a compiler do?",
    "How do plants make food?",
    "Tell me a fun fact about octopuses.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str, log_tail) -> None:
    """Polls GET url/health until 200; raises with the log tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready after {timeout}s:\n{log_tail()}")


class ServerProcess:
    """`python -m sglang_dflash.launch_server ARGS --host 127.0.0.1 --port <free>` in its own process group."""

    def __init__(self, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="sglang-dflash-server-", suffix=".log")[1])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "sglang_dflash.launch_server", *args, "--host", "127.0.0.1", "--port",
               str(self.port), "--api-key", API_KEY, "--log-level", "warning"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        wait_healthy(self.proc, self.url, timeout, "server", self.log_tail)
        return self

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)

    # ---- clients ----
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=AUTH, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", headers=kw.pop("headers", AUTH), timeout=300, **kw)

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def wait_idle(self, timeout: float = 10) -> dict:
        """/get_server_info once no request is left (the scheduler publishes it after each step)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
            if (idle and info["available_kv_tokens"] == info["max_total_num_tokens"]) or time.monotonic() > deadline:
                return info
            time.sleep(0.1)


@functools.cache
def random_drafter() -> str:
    """A randomly initialised DFlash drafter (2 layers, block 16) for the default target."""
    from sglang_dflash.models.dflash import random_draft_model
    from sglang_dflash.models.dflash_config import DFlashConfig
    from sglang_dflash.models.model_store import load_model_config, resolve_model_dir

    path = tempfile.mkdtemp(prefix="sglang-dflash-drafter-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    cfg = DFlashConfig.for_target(load_model_config(resolve_model_dir(None)), 2, 16, mask_token_id=16)
    random_draft_model(cfg).save_pretrained(path)
    return path


def dflash_args(max_total_tokens: int = 4096, *extra: str) -> list[str]:
    """DFLASH, block 4, float32 (for exact equality), a small KV pool and context."""
    return [
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", random_drafter(),
        "--speculative-num-draft-tokens", "4", "--dtype", "float32", "--max-total-tokens", str(max_total_tokens),
        "--context-length", "1024", *extra,
    ]


KV_PRESSURE_TOKENS = 192  # a few requests fit; more must be retracted and recomputed
SERVERS = {  # name -> CLI args (built on first use: the drafter is written then)
    "dflash": lambda: dflash_args(4096, "--enable-overlap-schedule"),  # the GPU default loop, forced on CPU
    "dflash_plain": lambda: dflash_args(4096, "--disable-overlap-schedule"),
    "kv_pressure": lambda: dflash_args(KV_PRESSURE_TOKENS, "--enable-overlap-schedule"),
}
_running: dict[str, ServerProcess] = {}


def shared_server(name: str) -> ServerProcess:
    """The named server of SERVERS, ready. The first call starts them all (tests drive one server at a time,
    on one core: the others start meanwhile); all are stopped when the test session exits."""
    for other, args in SERVERS.items():
        if other not in _running:
            _running[other] = ServerProcess(args())
    return _running[name].wait_ready()


@atexit.register
def _stop_all() -> None:
    for server in _running.values():
        server.stop()


def chat(client: openai.OpenAI, prompt: str, max_tokens: int = MAX_TOKENS, **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}, **kw,
    )


_alone: dict[str, str] = {}


def alone_outputs() -> dict[str, str]:
    """Greedy text of each prompt, sent alone (one at a time) to the plain-loop DFLASH server."""
    if not _alone:
        client = shared_server("dflash_plain").client()
        for p in PROMPTS:
            _alone[p] = chat(client, p).choices[0].message.content
    return _alone


async def concurrent_chats(name: str, prompts: list[str]) -> list:
    """Greedy chats of MAX_TOKENS tokens (ignore_eos), sent at once to the named server."""
    client = shared_server(name).async_client()
    calls = [
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )
        for p in prompts
    ]
    return await asyncio.gather(*calls)
