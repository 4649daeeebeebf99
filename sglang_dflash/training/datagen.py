"""Regenerates training responses with the target itself (our engine, continuous batching).

Requests stream through the scheduler (new prompts join as others finish). Finished records are kept in
compressed shards `shard_XXXXX.npz` of `shard_size` records: the token ids as uint16 (prompt then response,
concatenated), their lengths, and a JSON list of the rest (id, source, finish reason, sampling). A shard is
written when it is full (and the last one at the end), so a killed run loses at most one shard's records;
prompts already present are skipped, so it resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sglang_dflash.training.prompts import load_prompts

META_KEYS = ("id", "source", "finish", "sampling")


def sampling_for(index: int, max_new_tokens: int) -> dict:
    """Three greedy responses to one sampled at T=0.7 (greedy ones are what greedy acceptance learns from),
    seeded by the prompt index."""
    if index % 4 != 3:
        return {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    return {"temperature": 0.7, "top_p": 0.95, "seed": index, "max_new_tokens": max_new_tokens}


def write_shard(path: Path, records: list[dict]) -> None:
    """Records (prompt_ids, response_ids and META_KEYS) -> one compressed .npz (written whole, then renamed)."""
    ids = [t for r in records for t in r["prompt_ids"] + r["response_ids"]]
    assert max(ids, default=0) < 1 << 16, "token ids must fit uint16"
    meta = json.dumps([{k: r[k] for k in META_KEYS} for r in records])
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, tokens=np.asarray(ids, dtype=np.uint16),
                        prompt_lens=np.asarray([len(r["prompt_ids"]) for r in records], dtype=np.int32),
                        response_lens=np.asarray([len(r["response_ids"]) for r in records], dtype=np.int32),
                        meta=np.frombuffer(meta.encode(), dtype=np.uint8))
    tmp.replace(path)


def read_shard(path: Path) -> list[dict]:
    with np.load(path) as z:
        tokens, prompt_lens, response_lens = z["tokens"].astype(np.int64), z["prompt_lens"], z["response_lens"]
        meta = json.loads(z["meta"].tobytes().decode())
    records, pos = [], 0
    for m, n_prompt, n_response in zip(meta, prompt_lens.tolist(), response_lens.tolist()):
        prompt, response = tokens[pos : pos + n_prompt], tokens[pos + n_prompt : pos + n_prompt + n_response]
        records.append({**m, "prompt_ids": prompt.tolist(), "response_ids": response.tolist()})
        pos += n_prompt + n_response
    return records


def load_shards(data_dir: Path) -> list[dict]:
    return [r for path in sorted(Path(data_dir).glob("shard_*[0-9].npz")) for r in read_shard(path)]


class ShardWriter:
    """Collects records and writes each full shard of `shard_size`, numbered after the existing shards."""

    def __init__(self, out_dir: Path, shard_size: int):
        self.out_dir, self.shard_size = out_dir, shard_size
        self.index = len(list(out_dir.glob("shard_*[0-9].npz")))
        self.pending: list[dict] = []

    def write(self, rec: dict) -> None:
        self.pending.append(rec)
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            write_shard(self.out_dir / f"shard_{self.index:05d}.npz", self.pending)
            self.index, self.pending = self.index + 1, []


def generate_responses(
    engine, prompts_path: Path, out_dir: Path, num_prompts: int, shard_size: int, max_new_tokens: int, window: int,
    start: int = 0, time_budget_s: float | None = None, skip_ids: frozenset[str] = frozenset(),
) -> dict:
    """Prompts [start, start + num_prompts) of the prompt file but those in `out_dir` already or in `skip_ids`
    (indices seed the sampling, so a range regenerates the same records whatever else was generated). After
    `time_budget_s` it stops: the finished records are written, the unfinished ones dropped (aborted). Returns
    this run's records, output tokens and seconds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(enumerate(load_prompts(prompts_path)))[start : start + num_prompts]
    done = {r["id"] for r in load_shards(out_dir)} | skip_ids
    todo = [(i, p) for i, p in prompts if p["id"] not in done]
    writer = ShardWriter(out_dir, shard_size)
    scheduler, tm = engine.scheduler, engine.tokenizer_manager
    live: dict[str, tuple[dict, list[int], dict, object]] = {}
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="responses", unit="prompt")
    tokens, written, t0 = 0, 0, time.perf_counter()
    while todo or live:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            for rid in live:
                scheduler.abort_request(rid)
            break
        while todo and len(live) < window:
            i, p = todo.pop(0)
            ids = tm.chat_ids([{"role": "user", "content": p["prompt"]}])
            params = sampling_for(i, max_new_tokens)
            req = tm.make_req(input_ids=ids, sampling_params=params, rid=p["id"])
            scheduler.add_request(req)
            live[req.rid] = (p, ids, params, req)
        scheduler.run_step()
        for rid in [rid for rid, v in live.items() if v[3].finished()]:
            p, ids, params, req = live.pop(rid)
            writer.write({"id": p["id"], "source": p["source"], "prompt_ids": ids, "response_ids": req.output_ids,
                          "finish": req.finished_reason["type"], "sampling": params})
            tokens += len(req.output_ids)
            written += 1
            bar.update(1)
        live_tokens = sum(len(v[3].output_ids) for v in live.values())
        bar.set_postfix(tok_s=f"{(tokens + live_tokens) / (time.perf_counter() - t0):.0f}", refresh=False)
    writer.flush()
    bar.close()
    manifest = {"prompts": str(prompts_path), "start": start, "num_prompts": len(prompts), "shard_size": shard_size,
                "max_new_tokens": max_new_tokens}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return {"records": written, "output_tokens": tokens, "seconds": round(time.perf_counter() - t0, 1)}
