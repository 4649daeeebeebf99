"""A failed batch fails only the requests that caused it: each request's own batch inputs are built alone
(its checks and sampling tensors); those that fail are finished with the error and the batch runs again
without them. A fault no single request causes (the device, the model) propagates as before.

`forward_isolated` is the worker side: it reads only the worker and the batch's scheduling-time snapshots,
so the overlap loop can launch it before the previous batch is processed; `fail_culprits` is the host side."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dflash.sampling.sampler import SamplingBatchInfo
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch

PROBE_VOCAB = 2**31 - 1  # only fills the top_k of rows without one


@dataclass
class Outcome:
    """What running a batch in isolation gave: the batch that ran (None: no request was left), its result,
    and the requests dropped on the way with their errors."""

    batch: ScheduleBatch | None
    result: GenerationBatchResult | None
    culprits: list[tuple[Req, Exception]]


def probe(worker, req: Req) -> Exception | None:
    """The error building this request's own inputs raises, if any."""
    try:
        worker.validate_request(req)
        SamplingBatchInfo.from_params([req.sampling_params], PROBE_VOCAB, torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - whatever it is, it is this request's
        return e
    return None


def without(batch: ScheduleBatch, drop: list[Req]) -> ScheduleBatch | None:
    """`batch` less `drop`, from the batch's own snapshots (the host may have moved on since it was built)."""
    keep = [i for i, r in enumerate(batch.reqs) if r not in drop]
    if not keep:
        return None
    reqs = [batch.reqs[i] for i in keep]
    extend = batch.forward_mode.is_extend()
    prefix = [batch.prefix_lens[i] for i in keep] if extend else []
    lens = [batch.extend_lens[i] for i in keep] if extend else []
    out = ScheduleBatch(reqs, batch.forward_mode, prefix, lens)
    out.req_pool_indices = [batch.req_pool_indices[i] for i in keep]
    out.kv_bound, out.host_current = batch.kv_bound, batch.host_current
    if extend:
        starts = [sum(batch.extend_lens[:i]) for i in range(len(batch.reqs))]
        out.input_ids = [t for i in keep for t in batch.input_ids[starts[i] : starts[i] + batch.extend_lens[i]]]
        rows = set(batch.sample_rows)
        out.sample_rows = [j for j, i in enumerate(keep) if i in rows]
    return out


def forward_isolated(worker, batch: ScheduleBatch) -> Outcome:
    """Runs `batch` on the worker, dropping the requests whose own inputs fail and running the rest again."""
    culprits: list[tuple[Req, Exception]] = []
    while batch is not None:
        try:
            return Outcome(batch, worker.forward_batch_generation(batch), culprits)
        except Exception:
            found = [(r, e) for r in batch.reqs if (e := probe(worker, r)) is not None]
            if not found:
                raise
            culprits += found
            batch = without(batch, [r for r, _ in found])
    return Outcome(None, None, culprits)


def fail_culprits(sched, outcome: Outcome) -> list[Req]:
    """Finishes the dropped requests with their error and frees their memory; returns them."""
    for req, e in outcome.culprits:
        req.finish({"type": "abort", "message": f"request failed while building its batch: {e!r}",
                    "status_code": 500})
        sched.abort_request(req.rid)  # out of its queue (if still there), memory released
    return [r for r, _ in outcome.culprits]


def run_isolated(sched, batch: ScheduleBatch) -> tuple[ScheduleBatch | None, GenerationBatchResult | None, list[Req]]:
    """The plain loop: runs `batch` now; (the batch that ran, its result, the requests failed on the way)."""
    sched.launched += 1
    try:
        outcome = forward_isolated(sched.worker, batch)
    finally:  # the worker is done with the batch: its requests' memory may be freed
        sched.completed += 1
    return outcome.batch, outcome.result, fail_culprits(sched, outcome)
