"""Regenerates responses for the training prompts with the target model (resumable shards).

    nohup python scripts/generate_responses.py --num-prompts 8000 > runs/datagen.log 2>&1 &

data/responses (the default --out) is committed: commit new shards when a run ends, and start the next run
past the prompts already used (--start-index), so every session adds data instead of regenerating it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_dflash import Engine
from sglang_dflash.training.datagen import generate_responses, load_shards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=Path("data/prompts.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("data/responses"))
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--start-index", type=int, default=0, help="first prompt (e.g. past those already trained on)")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or xpu")
    ap.add_argument("--time-budget-s", type=float, default=None, help="stop after this long (unfinished dropped)")
    ap.add_argument("--skip-done-in", type=Path, nargs="*", default=[],
                    help="response dirs whose prompts are not regenerated (e.g. data/responses from a scratch --out)")
    ap.add_argument("--stats", type=Path, default=None, help="write this run's records, tokens, seconds (JSON)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(model_path=args.model_path, device=args.device, dtype=args.dtype,
                    max_running_requests=args.max_running_requests, max_total_tokens=args.max_running_requests * 1200)
    stats = generate_responses(engine, args.prompts, args.out, args.num_prompts, args.shard_size,
                               args.max_new_tokens, window=2 * args.max_running_requests, start=args.start_index,
                               time_budget_s=args.time_budget_s,
                               skip_ids=frozenset(r["id"] for d in args.skip_done_in for r in load_shards(d)))
    engine.shutdown()
    print(json.dumps(stats))
    if args.stats:
        args.stats.write_text(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
