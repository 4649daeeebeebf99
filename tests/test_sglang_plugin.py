"""The SGLang plugin inside real SGLang 0.5.23 on CPU: `--speculative-algorithm DFLASH` runs our worker, and
its outputs equal SGLang's without speculation, token for token (overlap loop and --disable-overlap-schedule).

Needs the SGLang CPU venv (scripts/install_sglang_cpu.sh); skipped without it. Three servers start once for
the module: the reference without speculation and two DFLASH servers. The drafter is random except for a
one-token draft vocabulary (" hello"): every draft is " hello", so blocks are fully accepted wherever the
target repeats " hello" and rejected elsewhere, which exercises both paths. The reference runs with
--disable-overlap-schedule because SGLang's overlap loop applies penalties one token late; our worker
applies them exactly, as SGLang's synchronous loop does (greedy outputs are the same in both loops).
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from sglang_helpers import REPO, VENV_PYTHON, SGLangServer, sglang_env

pytestmark = pytest.mark.skipif(
    not VENV_PYTHON.exists(), reason=f"no SGLang CPU venv at {VENV_PYTHON.parent.parent} "
    "(create it with scripts/install_sglang_cpu.sh)"
)

WORKER = "sglang_dflash.integrations.sglang.worker.DFlashSGLangWorker"
MAX_TOKENS = 24
HELLO_PROMPT = "Repeat the word hello ten times: hello hello hello hello"
PROMPTS = [
    "Write a haiku about autumn.",
    "Say hello five times.",
    "What causes the seasons on Earth?",
    "Give me a recipe for tomato soup.",
    "Repeat after me: hello hello hello hello hello hello",
    "List three tips for clear writing.",
    "What is a list in Python?",
    "Why is the sky blue?",
]
SPEC_SERVERS = ["overlap", "no_overlap"]
SHIPPED_DRAFTER = REPO / "sglang_dflash" / "drafters" / "smollm2-135m-instruct-dflash"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The default GGUF converted by our CLI (a cached conversion is copied)."""
    out = tmp_path_factory.mktemp("sglang") / "smollm2"
    res = subprocess.run([sys.executable, "-m", "sglang_dflash.convert", "--out", str(out)], capture_output=True,
                         text=True, check=True)
    assert res.stdout.strip() == str(out.resolve())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tokenizer, tmp_path_factory) -> Path:
    from sglang_dflash.models.dflash import random_draft_model
    from sglang_dflash.models.dflash_config import DFlashConfig
    from sglang_dflash.models.model_store import load_model_config

    (hello,) = tokenizer.encode(" hello", add_special_tokens=False)
    cfg = DFlashConfig.for_target(load_model_config(model_dir), 2, 16, mask_token_id=16)
    cfg.draft_vocab = [hello]
    out = tmp_path_factory.mktemp("sglang") / "hello-drafter"
    random_draft_model(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def servers(model_dir, drafter_dir) -> dict[str, SGLangServer]:
    spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter_dir)]
    started = {
        "reference": SGLangServer(model_dir, ["--disable-overlap-schedule"]),
        "overlap": SGLangServer(model_dir, spec),  # block size 16, from the drafter
        "no_overlap": SGLangServer(model_dir, [*spec, "--disable-overlap-schedule", "--speculative-num-draft-tokens",
                                               "8"]),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def chat_texts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in PROMPTS]


_solo: dict[str, list[dict]] = {}


def solo_outputs(server: SGLangServer, name: str, texts: list[str]) -> list[dict]:
    """Each prompt alone, greedy; computed once per server."""
    if name not in _solo:
        _solo[name] = [server.generate(t, MAX_TOKENS) for t in texts]
    return _solo[name]


def test_plugin_registration(model_dir, drafter_dir):
    res = subprocess.run([str(VENV_PYTHON), "-W", "ignore", str(REPO / "tests" / "sglang_helpers.py"),
                          str(model_dir), str(drafter_dir)], capture_output=True, text=True, env=sglang_env(),
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["entry_points"].get("dflash") == "sglang_dflash.integrations.sglang:register"
    assert set(report["patched"]) >= {
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        "sglang.srt.speculative.spec_utils.spec_prepare_for_decode",
    }
    assert report["algorithm"] == "SGLANG_DFLASH" and report["num_draft_tokens"] == 16
    assert report["worker"] == WORKER
    assert report["cuda_graph_disabled_on_cuda"]  # our worker runs eager on GPUs, and says so
    # SGLANG_DFLASH_IMPL=sglang leaves DFLASH to SGLang, whose built-in refuses CPUs
    assert report["builtin"].startswith("refused:") and "not supported" in report["builtin"]


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_server_runs_our_worker(servers, name):
    server = servers[name]
    assert f"runs {WORKER}" in server.log()
    info = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list()
    assert info.data


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_greedy_generate_equals_no_speculation(servers, chat_texts, name):
    ref = solo_outputs(servers["reference"], "reference", chat_texts)
    out = solo_outputs(servers[name], name, chat_texts)
    for r, o in zip(ref, out):
        assert o["output_ids"] == r["output_ids"]
        assert o["meta_info"]["spec_verify_ct"] >= 1


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_accept_length(servers, name):
    meta = servers[name].generate(HELLO_PROMPT, 32, ignore_eos=True)["meta_info"]
    assert meta["spec_accept_length"] > 1.5


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_concurrent_requests_equal_solo(servers, chat_texts, name):
    server = servers[name]
    solo = solo_outputs(server, name, chat_texts)
    with concurrent.futures.ThreadPoolExecutor(len(chat_texts)) as pool:
        together = list(pool.map(lambda t: server.generate(t, MAX_TOKENS), chat_texts))
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in solo]


@pytest.mark.parametrize("name", SPEC_SERVERS[:1])  # the worker code is the same in both loops
def test_chat_equals_no_speculation(servers, name):
    def chat(server: SGLangServer, prompt: str, stream: bool) -> str:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        kwargs = dict(model="default", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                      temperature=0)
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = client.chat.completions.create(**kwargs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    for prompt in PROMPTS[:3]:
        expected = chat(servers["reference"], prompt, stream=False)
        assert chat(servers[name], prompt, stream=False) == expected
        assert chat(servers[name], prompt, stream=True) == expected


@pytest.mark.parametrize("name", SPEC_SERVERS[:1])  # the worker code is the same in both loops
def test_penalties_and_logit_bias_equal_no_speculation(servers, tokenizer, name):
    (hello,) = tokenizer.encode(" hello", add_special_tokens=False)
    cases = [
        {"frequency_penalty": 1.5}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.3},
        {"min_new_tokens": 20}, {"logit_bias": {str(hello): -3.0}},
    ]
    for params in cases:  # whole blocks are accepted until a penalty changes the target's choice
        ref = servers["reference"].generate(HELLO_PROMPT, MAX_TOKENS, **params)
        assert servers[name].generate(HELLO_PROMPT, MAX_TOKENS, **params)["output_ids"] == ref["output_ids"], params


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_logprobs_and_json_schema(servers, name):
    body = dict(return_logprob=True, top_logprobs_num=2)
    ref = servers["reference"].generate(HELLO_PROMPT, 12, body)
    out = servers[name].generate(HELLO_PROMPT, 12, body)
    assert out["output_ids"] == ref["output_ids"]
    for (lp, tok, _), (ref_lp, ref_tok, _) in zip(out["meta_info"]["output_token_logprobs"],
                                                  ref["meta_info"]["output_token_logprobs"]):
        assert tok == ref_tok and lp == pytest.approx(ref_lp, abs=1e-3)
    top, ref_top = out["meta_info"]["output_top_logprobs"], ref["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in row] for row in top] == [[t for _, t, _ in row] for row in ref_top]

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    def ask(server: SGLangServer) -> str:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        return client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
            max_tokens=40, temperature=0, response_format=fmt,
        ).choices[0].message.content

    assert ask(servers[name]) == ask(servers["reference"])


@pytest.mark.parametrize("name", SPEC_SERVERS)
def test_sampling(servers, chat_texts, name):
    """Sampled requests (temperature, top-p, top-k, min-p) run through the rejection-sampling accept."""
    params = dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda t: servers[name].generate(t, MAX_TOKENS, **params), chat_texts[:4]))
    for o in outs:
        assert len(o["output_ids"]) == MAX_TOKENS and o["meta_info"]["spec_verify_ct"] >= 1


def test_shipped_drafter_accept_length(servers, model_dir, chat_texts):
    server = SGLangServer(model_dir, ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                                      str(SHIPPED_DRAFTER)])
    try:
        server.wait_ready()
        outs = [server.generate(t, MAX_TOKENS) for t in chat_texts]
        ref = solo_outputs(servers["reference"], "reference", chat_texts)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
        tau = sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs)
        assert tau > 1.0  # drafts of the shipped drafter are accepted inside SGLang
        if tau <= 1.5:  # issue 7's bar; the shipped drafter is still undertrained (issue 4)
            pytest.xfail(f"shipped drafter accept length {tau:.2f} <= 1.5 on these prompts")
    finally:
        server.stop()


@pytest.mark.parametrize("name", SPEC_SERVERS[:1])  # the worker code is the same in both loops
def test_shared_system_prompt_equals_no_speculation(servers, tokenizer, name):
    """Requests sharing a system prompt: SGLang's radix cache gives the later ones the slots the first one
    filled, and our draft KV pool is indexed by those slots; outputs equal those with nothing cached."""
    system = "You are a concise assistant for a bakery. " * 12 + "Answer in one or two sentences."
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}],
                                           tokenize=False, add_generation_prompt=True) for p in PROMPTS[:4]]
    server = servers[name]
    cold = []
    for text in texts:
        assert httpx.post(f"{server.url}/flush_cache", params={"timeout": 30}, timeout=60).status_code == 200
        cold.append(server.generate(text, MAX_TOKENS))
    warm = [server.generate(text, MAX_TOKENS) for text in texts]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in cold)
    assert all(o["meta_info"]["cached_tokens"] > 80 for o in warm)
    assert [o["output_ids"] for o in warm] == [o["output_ids"] for o in cold]
    ref = [servers["reference"].generate(text, MAX_TOKENS) for text in texts]
    assert [o["output_ids"] for o in warm] == [o["output_ids"] for o in ref]
