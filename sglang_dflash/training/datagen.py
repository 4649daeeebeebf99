"""Regenerates training responses with the target itself (our engine, continuous batching).

Requests stream through the scheduler (new prompts join as others finish); finished records are
appended to token-id shards `shard_XXXXX.jsonl` (prompt_ids, response_ids, the sampling used).
Prompts already present in the shards are skipped, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from sglang_dflash.training.prompts import load_prompts


def sampling_for(index: int, max_new_tokens: int) -> dict:
    """Greedy and T=0.7 samples mixed half and half, seeded by the prompt index."""
    if index % 2 == 0:
        return {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    return {"temperature": 0.7, "top_p": 0.95, "seed": index, "max_new_tokens": max_new_tokens}


def load_shards(data_dir: Path) -> list[dict]:
    records = []
    for path in sorted(Path(data_dir).glob("shard_*.jsonl")):
        with open(path) as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return records


class ShardWriter:
    """Appends records to shard files of `shard_size` lines, continuing after existing shards."""

    def __init__(self, out_dir: Path, shard_size: int):
        self.out_dir, self.shard_size = out_dir, shard_size
        existing = sorted(out_dir.glob("shard_*.jsonl"))
        self.index = len(existing)
        self.count = 0
        if existing:
            with open(existing[-1]) as f:
                n = sum(1 for line in f if line.strip())
            if n < shard_size:
                self.index, self.count = len(existing) - 1, n

    def write(self, rec: dict) -> None:
        if self.count >= self.shard_size:
            self.index, self.count = self.index + 1, 0
        with open(self.out_dir / f"shard_{self.index:05d}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.count += 1


def generate_responses(
    engine, prompts_path: Path, out_dir: Path, num_prompts: int, shard_size: int, max_new_tokens: int, window: int,
    start: int = 0,
) -> None:
    """Prompts [start, start + num_prompts) of the prompt file (indices seed the sampling, so a range
    regenerates the same records whatever else was generated)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(enumerate(load_prompts(prompts_path)))[start : start + num_prompts]
    done = {r["id"] for r in load_shards(out_dir)}
    todo = [(i, p) for i, p in prompts if p["id"] not in done]
    writer = ShardWriter(out_dir, shard_size)
    scheduler, tm = engine.scheduler, engine.tokenizer_manager
    live: dict[str, tuple[dict, list[int], dict, object]] = {}
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="responses", unit="prompt")
    tokens, t0 = 0, time.perf_counter()
    while todo or live:
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
            bar.update(1)
        live_tokens = sum(len(v[3].output_ids) for v in live.values())
        bar.set_postfix(tok_s=f"{(tokens + live_tokens) / (time.perf_counter() - t0):.0f}", refresh=False)
    bar.close()
    manifest = {"prompts": str(prompts_path), "start": start, "num_prompts": len(prompts), "shard_size": shard_size,
                "max_new_tokens": max_new_tokens}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
