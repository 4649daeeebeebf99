"""A failed batch fails only the requests that caused it: each request's own batch inputs are built alone
(its checks and sampling tensors); those that fail are finished with the error and the batch runs again
without them. A fault no single request causes (the device, the model) propagates as before."""

from __future__ import annotations

import torch

from sglang_dflash.sampling.sampler import SamplingBatchInfo
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch

PROBE_VOCAB = 2**31 - 1  # only fills the top_k of rows without one


def probe(worker, req: Req) -> Exception | None:
    """The error building this request's own inputs raises, if any."""
    try:
        worker.validate_request(req)
        SamplingBatchInfo.from_params([req.sampling_params], PROBE_VOCAB, torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - whatever it is, it is this request's
        return e
    return None


def without(batch: ScheduleBatch, drop: list[Req]) -> ScheduleBatch | None:
    keep = [i for i, r in enumerate(batch.reqs) if r not in drop]
    if not keep:
        return None
    reqs = [batch.reqs[i] for i in keep]
    if not batch.forward_mode.is_extend():
        return ScheduleBatch(reqs, batch.forward_mode)
    prefix, extend = [batch.prefix_lens[i] for i in keep], [batch.extend_lens[i] for i in keep]
    return ScheduleBatch(reqs, batch.forward_mode, prefix, extend)


def run_isolated(sched, batch: ScheduleBatch) -> tuple[ScheduleBatch | None, GenerationBatchResult | None, list[Req]]:
    """Runs `batch` on the worker: (the batch that ran, its result, the requests failed on the way)."""
    failed: list[Req] = []
    while batch is not None:
        sched.launched += 1
        try:
            return batch, sched.worker.forward_batch_generation(batch), failed
        except Exception:
            culprits = [(r, e) for r in batch.reqs if (e := probe(sched.worker, r)) is not None]
            if not culprits:
                raise
            for req, e in culprits:
                req.finish({"type": "abort", "message": f"request failed while building its batch: {e!r}",
                            "status_code": 500})
                sched.abort_request(req.rid)  # out of its queue, memory released
            failed += [r for r, _ in culprits]
            batch = without(batch, failed)
        finally:  # a failed batch is over too: its requests' memory may be freed
            sched.completed += 1
    return None, None, failed
