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
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[1, 2, 10**7], sampling_params={"max_new_tokens": 4})
    kv_clean(engine)


def test_prompt_longer_than_the_context(small_context_engine, kv_clean):
    ids = list(range(100, 100 + CONTEXT + 5))
    with pytest.raises(ValueError, match="context"):
        small_context_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    kv_clean(small_context_engine)
    # a prompt that fits is served, and generation stops at the context length
    out = small_context_engine.generate(input_ids=ids[:20], sampling_params={"max_new_tokens": 64, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 20 + out["meta_info"]["completion_tokens"] <= CONTEXT
    kv_clean(small_context_engine)


def test_stream_takes_one_prompt(engine, kv_clean):
    with pytest.raises(ValueError, match="stream"):
        engine.generate(["a", "b"], {"max_new_tokens": 2}, stream=True)
    kv_clean(engine)
