"""Bad input is a ValueError that names the field, raised before anything is allocated."""

from __future__ import annotations

import pytest

from sglang_dflash import Engine

CONTEXT = 32


@pytest.fixture(scope="module")
def small_context_engine(tiny_qwen3_dir) -> Engine:
    eng = Engine(model_path=str(tiny_qwen3_dir), dtype="float32", context_length=CONTEXT, max_total_tokens=256)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(
    "params,field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 8}, "max_tokens"),
        ({"temperature": 0, "bogus_key": 1}, "bogus_key"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": 1e4}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"top_p": None}, "top_p"),
        ({"top_p": "0.5"}, "top_p"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 10**6}, "top_k"),  # more than the vocabulary
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 4.0}, "max_new_tokens"),
        ({"ignore_eos": "x"}, "ignore_eos"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_bad_sampling_params(engine, kv_clean, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", params)
    # one bad request in a batch rejects the whole call before any request starts
    with pytest.raises(ValueError, match=field):
        engine.generate(["Hello", "World"], [{"max_new_tokens": 4}, params])
    kv_clean(engine)


@pytest.mark.parametrize(
    "kwargs",
    [{"prompt": ""}, {"input_ids": []}, {"prompt": ["ok", ""]}, {"input_ids": [[5, 6], []]}],
)
def test_empty_prompt(engine, kv_clean, kwargs):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(sampling_params={"max_new_tokens": 4}, **kwargs)
    kv_clean(engine)


def test_token_ids_outside_the_vocab(engine, kv_clean):
    for ids in ([1, 2, 10**7], [True, False], [1, -1]):
        with pytest.raises(ValueError, match="input_ids"):
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    kv_clean(engine)


def test_lone_surrogate_is_refused(engine, kv_clean):
    with pytest.raises(ValueError, match="surrogate"):
        engine.generate("a\ud800b", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match=r"messages\[0\].content .*surrogate"):
        engine.chat([{"role": "user", "content": "a\udfffb"}], {"max_new_tokens": 4})
    kv_clean(engine)


def test_a_chat_template_that_refuses_the_messages_is_a_value_error(engine, kv_clean, monkeypatch):
    """Templates raise on conversations they do not accept (Qwen3: no user turn); that is the client's error."""
    tokenizer = engine.tokenizer_manager.tokenizer
    strict = "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last turn must be the user') }}{% endif %}"
    monkeypatch.setattr(tokenizer, "chat_template", strict + tokenizer.chat_template)
    with pytest.raises(ValueError, match="chat template rejected the messages: the last turn must be the user"):
        engine.chat([{"role": "system", "content": "hi"}], {"max_new_tokens": 4})
    assert engine.chat([{"role": "user", "content": "hi"}], {"max_new_tokens": 2})["output_ids"]
    kv_clean(engine)


def test_request_beyond_the_kv_pool_is_refused_before_it_runs(tiny_qwen3_dir, kv_clean):
    with Engine(model_path=str(tiny_qwen3_dir), dtype="float32", context_length=512, max_total_tokens=64) as eng:
        with pytest.raises(ValueError, match="max_tokens: 10 prompt tokens \\+ 60 new tokens .* KV cache pool of 64"):
            eng.generate(input_ids=list(range(100, 110)), sampling_params={"max_new_tokens": 60})
        kv_clean(eng)
        out = eng.generate(input_ids=list(range(100, 110)), sampling_params={"max_new_tokens": 40, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        kv_clean(eng)


def test_prompt_longer_than_the_context(small_context_engine, kv_clean):
    ids = list(range(100, 100 + CONTEXT + 5))
    with pytest.raises(ValueError, match="context"):
        small_context_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    kv_clean(small_context_engine)
    # prompt + max_new_tokens beyond the context is refused offline as over HTTP (one request builder) ...
    with pytest.raises(ValueError, match="maximum context length"):
        small_context_engine.generate(input_ids=ids[:20], sampling_params={"max_new_tokens": 64})
    # ... and a request that fits is served within the context
    out = small_context_engine.generate(input_ids=ids[:20],
                                        sampling_params={"max_new_tokens": CONTEXT - 20, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 20 + out["meta_info"]["completion_tokens"] <= CONTEXT
    kv_clean(small_context_engine)


def test_stream_takes_one_prompt(engine, kv_clean):
    with pytest.raises(ValueError, match="stream"):
        engine.generate(["a", "b"], {"max_new_tokens": 2}, stream=True)
    kv_clean(engine)
