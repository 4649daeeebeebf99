"""Engine end to end (float32, greedy): token-for-token equal to transformers `generate`, batching and
chunked prefill invisible, stop strings / stop token ids, streaming."""

from __future__ import annotations

import copy

import pytest
import torch

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def alone(engine, chat_ids, greedy) -> list[dict]:
    """Each chat prompt generated on its own (the reference for the batching tests)."""
    return [engine.generate(input_ids=ids, sampling_params=greedy(max_new_tokens=16)) for ids in chat_ids]


def test_greedy_matches_transformers_generate(engine, hf_model, chat_ids, greedy, kv_clean):
    """64 tokens per prompt, past EOS on both sides (ignore_eos / an unreachable eos id), token for token."""
    prompts = chat_ids[:5]
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id = hf_model.config.vocab_size  # an id never generated: no early stop
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_model.generate(
                x, attention_mask=torch.ones_like(x), generation_config=config, max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )[0, len(ids) :].tolist()
        assert len(ref) == NEW_TOKENS
        assert out["output_ids"] == ref
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    kv_clean(engine)


@pytest.mark.parametrize("chunk,overlap", [(None, True), (16, False)])
def test_batching_is_invisible(engine, chat_ids, alone, greedy, kv_clean, monkeypatch, chunk, overlap):
    """8 prompts of different lengths in one call == one at a time; also with prefill in 16-token chunks
    (each prompt needs several) and with the overlap scheduler off."""
    if chunk is not None:
        monkeypatch.setattr(engine.scheduler, "chunked_prefill_size", chunk)
    monkeypatch.setattr(engine.scheduler, "enable_overlap", overlap)
    assert len({len(ids) for ids in chat_ids}) > 4 and min(map(len, chat_ids)) > 2 * 16
    outs = engine.generate(input_ids=chat_ids, sampling_params=greedy(max_new_tokens=16))
    assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]
    assert [o["text"] for o in outs] == [a["text"] for a in alone]
    kv_clean(engine)


def test_text_prompt_and_list_forms(engine, greedy, kv_clean):
    one = engine.generate("The capital of France is", greedy(max_new_tokens=8))
    ids = engine.tokenizer_manager.encode("The capital of France is")
    assert engine.generate(input_ids=ids, sampling_params=greedy(max_new_tokens=8))["output_ids"] == one["output_ids"]
    params = [greedy(max_new_tokens=8), greedy(max_new_tokens=3)]
    many = engine.generate(["The capital of France is", "1, 2, 3,"], params)
    assert many[0]["output_ids"] == one["output_ids"] and len(many[1]["output_ids"]) == 3
    assert one["text"] == engine.tokenizer.decode(one["output_ids"], skip_special_tokens=True)
    chat = engine.chat([{"role": "user", "content": "Hi!"}], greedy(max_new_tokens=4))
    assert chat["meta_info"]["completion_tokens"] == 4
    kv_clean(engine)


def test_stop_string_cuts_the_text(engine, chat_ids, alone, greedy, kv_clean):
    ref = alone[2]["text"]
    stop = ref[len(ref) // 2 : len(ref) // 2 + 4]
    cut = ref.index(stop)
    out = engine.generate(input_ids=chat_ids[2], sampling_params=greedy(max_new_tokens=16, stop=[stop, "@@never"]))
    assert out["text"] == ref[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == alone[2]["output_ids"][: len(out["output_ids"])]
    kv_clean(engine)


def test_stop_token_ids_end_the_output(engine, chat_ids, alone, greedy, kv_clean):
    ref = alone[3]["output_ids"]
    k = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])  # first occurrence, past a few tokens
    out = engine.generate(input_ids=chat_ids[3], sampling_params=greedy(max_new_tokens=16, stop_token_ids=[ref[k]]))
    assert out["output_ids"] == ref[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[k]}
    assert alone[3]["text"].startswith(out["text"])
    kv_clean(engine)


def test_eos_stops_unless_ignored(engine, greedy, kv_clean):
    eos = engine.tokenizer.eos_token_id
    out = engine.chat([{"role": "user", "content": "Say hi."}], greedy(max_new_tokens=32))
    assert out["output_ids"][-1] == eos and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    n = len(out["output_ids"]) + 4
    long = engine.chat([{"role": "user", "content": "Say hi."}], greedy(max_new_tokens=n, ignore_eos=True))
    assert len(long["output_ids"]) == n and long["output_ids"][: n - 4] == out["output_ids"]
    kv_clean(engine)


@pytest.mark.parametrize("with_stop", [False, True])
def test_stream_concatenates_to_the_full_text(engine, greedy, kv_clean, with_stop):
    prompt = "Once upon a time, in a small village by the sea,"
    params = greedy(max_new_tokens=24)
    if with_stop:  # a stop string from the middle of the output: the stream must hold back its prefix
        text = engine.generate(prompt, params)["text"]
        params["stop"] = [text[len(text) // 2 : len(text) // 2 + 5]]
    full = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    kv_clean(engine)
