"""A request that breaks its batch fails alone, in the plain loop and in the overlap loop (where the batch
after it is already in flight when the fault surfaces), with the AR and the DFlash worker: a fault injected
into one request's sampling-tensor building (while 4 others run in the same batches), at its prefill or in a
later decode step, finishes only that request, with the reason; the 4 produce exactly what they produce
alone, and every KV slot comes back. A fault no single request causes still propagates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import ENGINE_POOL
from server_helpers import random_drafter

from sglang_dflash import Engine
from sglang_dflash.sampling import sampler

POISON_SEED = 4242
MAX_NEW = 10
ENGINES = {  # name -> Engine kwargs beyond the shared engine's (None: the shared plain-loop AR engine)
    "plain-ar": None,
    "overlap-ar": lambda: {"disable_overlap_schedule": False},
    "plain-dflash": lambda: dflash(disable_overlap_schedule=True),
    "overlap-dflash": lambda: dflash(disable_overlap_schedule=False),
}


def dflash(**kw) -> dict:
    return {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": random_drafter(),
            "speculative_num_draft_tokens": 4, "speculative_adaptive": False, **kw}


@pytest.fixture(scope="module", params=list(ENGINES))
def loop_engine(request, engine: Engine) -> Engine:
    if ENGINES[request.param] is None:
        yield engine
        return
    kwargs = ENGINES[request.param]()
    eng = Engine(dtype="float32", max_total_tokens=ENGINE_POOL, **kwargs)
    assert eng.scheduler.enable_overlap == request.param.startswith("overlap")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def alone(engine: Engine, chat_ids: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of chat_ids[:6], each run alone on the shared engine."""
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in chat_ids[:6]]


@pytest.fixture
def poison(monkeypatch) -> Callable[[int], None]:
    """poison(n): SamplingBatchInfo.from_params raises for any batch holding a request seeded with
    POISON_SEED, from the n-th such batch on (1: its prefill; 3: its second decode step)."""
    real = sampler.SamplingBatchInfo.from_params.__func__

    def arm(first: int) -> None:
        seen = 0

        def from_params(cls, params, vocab_size, device):
            nonlocal seen
            if any(p.seed == POISON_SEED for p in params):
                seen += 1
                if seen >= first:
                    raise OverflowError("injected fault while building sampling tensors")
            return real(cls, params, vocab_size, device)

        monkeypatch.setattr(sampler.SamplingBatchInfo, "from_params", classmethod(from_params))

    return arm


@pytest.mark.parametrize("poison_at, fault_from", [(0, 1), (4, 1), (2, 3), (4, 3)],
                         ids=["first-prefill", "last-prefill", "mid-decode", "last-decode"])
def test_poison_request_fails_alone(loop_engine, chat_ids, alone, kv_clean, poison, poison_at, fault_from):
    poison(fault_from)
    ids = chat_ids[:4]
    ids.insert(poison_at, chat_ids[5])
    params = [{"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True} for _ in ids]
    params[poison_at]["seed"] = POISON_SEED
    outs = loop_engine.generate(input_ids=ids, sampling_params=params)
    bad = outs.pop(poison_at)
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected fault" in bad["meta_info"]["finish_reason"]["message"]
    got = bad["output_ids"]
    assert (got == []) if fault_from == 1 else (0 < len(got) < MAX_NEW and got == alone[5][: len(got)]), got
    assert [o["output_ids"] for o in outs] == alone[:4]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    kv_clean(loop_engine)


def test_device_fault_propagates(loop_engine, chat_ids, greedy, kv_clean, monkeypatch):
    """A fault in the forward itself (no request's own inputs fail alone) is not blamed on a request."""
    worker = loop_engine.scheduler.worker

    def broken(batch):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(worker, "forward_batch_generation", broken)
    with pytest.raises(RuntimeError, match="device fell over"):
        loop_engine.generate(input_ids=chat_ids[:2], sampling_params=greedy(max_new_tokens=4))
    kv_clean(loop_engine)
