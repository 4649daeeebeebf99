"""The sync census: what it counts, on known operations; and the blocking host-device operations of one decode
step of the real engine (AR, DFLASH in fixed blocks, DFLASH with adaptive blocks and lookup; greedy, sampled and
with penalties; batch 1 and 8): exactly one per step, the wait for the step's result."""

from __future__ import annotations

import pytest
import torch
from dflash_helpers import CENSUS_ENGINES, census_engine, decode_step_census

from sglang_dflash.device import HostCopy, upload
from sglang_dflash.sync_census import SyncCensus

STEPS = 4  # decode steps counted per case: the adaptive engine's plans (and so its code paths) vary by step


def test_census_counts_each_blocking_kind_and_nothing_else():
    x = torch.arange(10)
    with SyncCensus() as census:
        x.tolist()
        x[0].item()
        bool(x[1] > 0)
        x[x > 3]
        torch.nonzero(x)
        torch.repeat_interleave(x, x)
        x.repeat_interleave(x, 0)
        x.numpy()
        torch.tensor([1, 2, 3])
        HostCopy(x).wait()
    kinds = sorted(kind for kind, _ in census.sites)
    assert kinds == sorted(["tolist", "item", "item", "bool-mask index", "nonzero", "repeat_interleave",
                            "repeat_interleave", "numpy", "upload", "wait"])
    assert all(site.startswith("test_sync_census.py:") for _, site in census.sites)
    index = torch.tensor([1, 2])
    with SyncCensus() as census:  # sync-free: device-side arithmetic, integer indexing, sized outputs
        y = x * 2 + 1
        y[index]
        torch.repeat_interleave(x, x, output_size=45)
        x.repeat_interleave(x, 0, output_size=45)
        torch.where(x > 3, x, 0)
        x.to(torch.float32).softmax(0)
        torch.as_tensor(x)
        upload([1, 2, 3], torch.int64, x.device)  # pinned and non-blocking where it is a copy
        copy = HostCopy(x)
        assert copy.ready() and copy.host.tolist() == x.tolist()  # a landed host copy is read for free
    assert census.count == 1 and census.sites[0][0] == "tolist", census.sites  # x.tolist() above, not the copy's
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the instrumentation is undone
    assert torch.tensor is torch._C._VariableFunctions.tensor
    assert HostCopy.wait.__qualname__ == "HostCopy.wait"


@pytest.fixture(scope="module", params=CENSUS_ENGINES)
def engine(request):
    eng = census_engine(request.param)
    yield request.param, eng
    eng.shutdown()


@pytest.mark.parametrize(("sampling", "batch"), [("greedy", 1), ("greedy", 8), ("sampled", 1), ("sampled", 8),
                                                 ("penalties", 8)])
def test_decode_step_has_one_sync_the_result_read(engine, sampling: str, batch: int):
    name, eng = engine
    census = decode_step_census(eng, batch, sampling, steps=STEPS)
    print(f"{name} {sampling} batch {batch}: {census.count} in {STEPS} steps", dict(census.by_site()))
    assert census.count == STEPS, dict(census.by_site())
    assert all(kind == "wait" and site.endswith(" resolve") for kind, site in census.sites), census.sites
