"""Stops inside an accepted block: with the oracle drafter every block is accepted whole, so EOS-like stop
tokens, stop strings and max_new_tokens land mid-run; DFLASH must end exactly where AR does. Afterwards
the KV slots (shared by the target and draft pools) and the req_to_token rows are all free again."""

from __future__ import annotations

import pytest
from dflash_helpers import CHAT_PROMPTS, OracleDrafter, ar_engine, ar_reference, chat_ids, dflash_engine

from sglang_dflash import Engine

BLOCK = 16
REF_TOKENS = 128  # same reference as the greedy tests (computed once per session)


def mid_block(k: int) -> bool:
    """Output index k is inside a block, away from its ends (index 0 comes from the prefill, then blocks of 16)."""
    return 3 <= (k - 1) % BLOCK <= BLOCK - 4


def stop_token_params(ref: list[int]) -> dict:
    k = next(k for k in range(BLOCK + 1, len(ref)) if mid_block(k) and ref[k] not in ref[:k])
    return {"stop_token_ids": [ref[k]]}


def stop_string_params(ref: list[int], tokenizer) -> dict:
    for k in range(BLOCK + 1, len(ref)):
        before, upto = tokenizer.decode(ref[:k]), tokenizer.decode(ref[: k + 1])
        word = upto[len(before) :].strip()
        if mid_block(k) and len(word) >= 3 and word.isalpha() and word not in before:
            return {"stop": [word]}
    raise AssertionError("no stop string candidate")


@pytest.fixture(scope="module")
def cases() -> tuple[list[list[int]], list[list[int]], list[dict]]:
    """12 requests: a stop token, a stop string or a length cap, each falling mid-block."""
    ids = chat_ids(ar_engine(), CHAT_PROMPTS)
    refs = ar_reference(ids, REF_TOKENS)
    eos = ar_engine().tokenizer_manager.eos_token_ids
    tokenizer = ar_engine().tokenizer
    params = []
    for i, full in enumerate(refs):
        ref = full[: next((k for k, t in enumerate(full) if t in eos), len(full))]  # stop before any EOS
        kind = i % 3
        extra = (
            stop_token_params(ref) if kind == 0 else stop_string_params(ref, tokenizer) if kind == 1
            else {"max_new_tokens": BLOCK + 5 + i // 3}
        )
        params.append({"temperature": 0, "max_new_tokens": REF_TOKENS, **extra})
    return ids, refs, params


def assert_pools_full(engine: Engine) -> None:
    scheduler = engine.scheduler
    assert scheduler.in_flight is None and not scheduler.deferred_frees
    assert scheduler.allocator.available_size() == scheduler.allocator.size
    assert scheduler.req_to_token_pool.available_size() == scheduler.req_to_token_pool.size


def test_stops_inside_accepted_runs_match_ar(cases):
    ids, refs, params = cases
    expected = ar_engine().generate(input_ids=ids, sampling_params=params)
    engine = dflash_engine()
    worker = engine.scheduler.worker
    with OracleDrafter(ids, refs, worker.step.draft.config.vocab_size).installed(worker):
        outs = engine.generate(input_ids=ids, sampling_params=params)
    for got, want, p in zip(outs, expected, params):
        assert got["output_ids"] == want["output_ids"], p
        assert got["text"] == want["text"], p
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], p
        n = len(want["output_ids"])
        assert mid_block(n - 1) and n < REF_TOKENS, (n, p)  # the stop really fell inside a block ...
        hist = got["meta_info"]["spec_accept_histogram"]
        assert hist[-1] == got["meta_info"]["spec_verify_ct"], hist  # ... that was accepted whole
    assert_pools_full(engine)


def test_pools_full_after_abort():
    engine = dflash_engine()
    ids = chat_ids(engine, CHAT_PROMPTS[:1])[0]
    stream = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64}, stream=True)
    next(stream)
    next(stream)
    stream.close()  # aborts the request mid-generation
    while engine.scheduler.in_flight is not None:  # land the batch that was in flight
        engine.scheduler.run_step()
    assert not engine.scheduler.has_work()
    assert_pools_full(engine)
