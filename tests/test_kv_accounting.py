"""Every way a request can end returns all of its KV: finished, stopped, errored, aborted, retracted."""

from __future__ import annotations

import pytest

from sglang_dflash import Engine

TIGHT_POOL = 128  # token slots: three chat prompts cannot all decode at once


@pytest.fixture(scope="module")
def tight_engine() -> Engine:
    eng = Engine(dtype="float32", max_total_tokens=TIGHT_POOL)
    yield eng
    eng.shutdown()


def test_mixed_endings_in_one_batch(engine, chat_ids, greedy, kv_clean):
    ref = engine.generate(input_ids=chat_ids[0], sampling_params=greedy(max_new_tokens=12))
    params = [
        greedy(max_new_tokens=12, ignore_eos=True),  # length
        greedy(max_new_tokens=64),  # EOS (short answer)
        greedy(max_new_tokens=12, stop=[ref["text"][4:8]]),  # stop string
        greedy(max_new_tokens=12, stop_token_ids=[ref["output_ids"][3]]),  # stop token
    ]
    outs = engine.generate(input_ids=[chat_ids[0]] * 4, sampling_params=params)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "stop", "stop", "stop"]
    kv_clean(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_worker_error_frees_everything(engine, chat_ids, greedy, kv_clean, monkeypatch, overlap):
    monkeypatch.setattr(engine.scheduler, "enable_overlap", overlap)
    worker = engine.scheduler.worker
    real = worker.forward_batch_generation
    calls = 0

    def flaky(batch):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("device fell over")
        return real(batch)

    monkeypatch.setattr(worker, "forward_batch_generation", flaky)
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.generate(input_ids=chat_ids[:3], sampling_params=greedy(max_new_tokens=16))
    kv_clean(engine)
    monkeypatch.setattr(worker, "forward_batch_generation", real)
    again = engine.generate(input_ids=chat_ids[0], sampling_params=greedy(max_new_tokens=4))  # still usable
    assert again["meta_info"]["completion_tokens"] == 4
    kv_clean(engine)


def test_closed_stream_aborts_and_frees(engine, greedy, kv_clean):
    params = greedy(max_new_tokens=64, ignore_eos=True)
    stream = engine.generate("Tell me a long story about dragons.", params, stream=True)
    next(stream)
    next(stream)
    stream.close()
    kv_clean(engine)


def test_retraction_is_invisible_and_frees(tight_engine, chat_ids, greedy, kv_clean):
    prompts = chat_ids[:3]
    assert sum(map(len, prompts)) < TIGHT_POOL < sum(len(p) + 24 for p in prompts)
    params = greedy(max_new_tokens=24, ignore_eos=True)
    alone = [tight_engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    before = tight_engine.scheduler.num_retractions
    outs = tight_engine.generate(input_ids=prompts, sampling_params=params)
    assert tight_engine.scheduler.num_retractions > before
    assert [o["output_ids"] for o in outs] == alone
    kv_clean(tight_engine)


def test_request_larger_than_the_pool_is_refused(tight_engine, chat_ids, greedy, kv_clean):
    """prompt + max_new_tokens beyond the KV pool could never finish: refused at admission, nothing held."""
    ids = (chat_ids[0] * 3)[: TIGHT_POOL - 16]
    with pytest.raises(ValueError, match="KV cache pool"):
        tight_engine.generate(input_ids=ids, sampling_params=greedy(max_new_tokens=400, ignore_eos=True))
    kv_clean(tight_engine)
