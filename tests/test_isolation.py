"""A request that breaks its batch fails alone: a fault injected into one request's sampling-tensor building
(while 4 others run in the same batches) finishes only that request, with the reason; the 4 produce exactly
what they produce alone, and every KV slot comes back. A fault no single request causes still propagates."""

from __future__ import annotations

import pytest

from sglang_dflash.sampling import sampler

POISON_SEED = 4242
MAX_NEW = 12


@pytest.fixture
def poisoned(monkeypatch):
    """SamplingBatchInfo.from_params raises for any batch holding a request seeded with POISON_SEED."""
    real = sampler.SamplingBatchInfo.from_params.__func__

    def from_params(cls, params, vocab_size, device):
        if any(p.seed == POISON_SEED for p in params):
            raise OverflowError("injected fault while building sampling tensors")
        return real(cls, params, vocab_size, device)

    monkeypatch.setattr(sampler.SamplingBatchInfo, "from_params", classmethod(from_params))


@pytest.mark.parametrize("poison_at", [0, 2, 4])  # in the prefill batch and mid-batch / last row in decode
def test_poison_request_fails_alone(engine, chat_ids, greedy, kv_clean, poisoned, poison_at):
    good = chat_ids[:4]
    params = greedy(max_new_tokens=MAX_NEW, ignore_eos=True)
    alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in good]
    ids = list(good)
    ids.insert(poison_at, chat_ids[5])
    all_params = [params] * 5
    all_params[poison_at] = {**params, "seed": POISON_SEED}
    outs = engine.generate(input_ids=ids, sampling_params=all_params)
    bad = outs.pop(poison_at)
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected fault" in bad["meta_info"]["finish_reason"]["message"]
    assert bad["output_ids"] == []
    assert [o["output_ids"] for o in outs] == alone
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    kv_clean(engine)


def test_device_fault_propagates(engine, chat_ids, greedy, kv_clean, monkeypatch):
    """A fault in the forward itself (no request's own inputs fail alone) is not blamed on a request."""
    worker = engine.scheduler.worker

    def broken(batch):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(worker, "forward_batch_generation", broken)
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.generate(input_ids=chat_ids[:2], sampling_params=greedy(max_new_tokens=4))
    kv_clean(engine)
