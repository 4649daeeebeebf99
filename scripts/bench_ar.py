"""Autoregressive decode speed: our Engine vs transformers `generate` on the same weights.

Batch 1, greedy, chat prompts, equal lengths (ignore_eos / min_new_tokens). Prefill is excluded by
timing N and 1 new tokens and dividing N - 1 by the difference; both systems run interleaved per prompt
so they share the machine's noise, and each prompt keeps its best of --repeats. On a shared machine,
--clock cpu (process CPU time) is steadier than wall time. Also our throughput with many prompts in one
generate call (prefill included).

    python scripts/bench_ar.py [--new-tokens 256] [--dtypes bfloat16 float32] [--threads 1] [--repeats 3]
                               [--clock wall|cpu] [--out bench_ar.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable

import torch

from sglang_dflash import Engine

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works and when you would use one.",
    "Give me a simple recipe for vegetable soup.",
    "What are the main causes of the seasons on Earth?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Describe the water cycle to a ten year old.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Explain recursion with a small example.",
    "Write a haiku about autumn and explain its imagery.",
    "What should I pack for a weekend hiking trip?",
    "Compare electric cars and petrol cars in a short paragraph.",
    "How does a binary search work?",
    "Suggest three names for a friendly coffee shop and explain each.",
]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def decode_seconds(gen: Callable[[list[int], int], None], ids: list[int], n: int, clock: Callable[[], float]) -> float:
    """Time of n - 1 decode steps: generating n tokens minus generating 1 (prefill + first token)."""
    return timed(lambda: gen(ids, n), clock) - timed(lambda: gen(ids, 1), clock)


def load_hf(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_generate(model, ids: list[int], n: int) -> None:
    x = torch.tensor([ids])
    with torch.inference_mode():
        model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict:
    engine = Engine(dtype=dtype, max_total_tokens=args.batch * (args.new_tokens + 256))
    model_dir = str(engine.scheduler.worker.model_runner.model_dir)
    hf = None if args.skip_hf else load_hf(model_dir, getattr(torch, dtype))
    chats = [engine.tokenizer_manager.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    n = args.new_tokens

    def ours(ids: list[int], new: int) -> None:
        engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True})

    ours(chats[0], 8)  # warm-up
    if hf is not None:
        hf_generate(hf, chats[0], 8)
    clock = CLOCKS[args.clock]
    tot = {"ours": 0.0, "hf": 0.0}
    for ids in chats[: args.prompts]:
        best = {"ours": float("inf"), "hf": float("inf")}
        for _ in range(args.repeats):
            best["ours"] = min(best["ours"], decode_seconds(ours, ids, n, clock))
            if hf is not None:
                best["hf"] = min(best["hf"], decode_seconds(functools.partial(hf_generate, hf), ids, n, clock))
        tot["ours"] += best["ours"]
        tot["hf"] += best["hf"]
    tokens = (n - 1) * args.prompts
    batch_ids = (chats * (args.batch // len(chats) + 1))[: args.batch]
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    seconds = timed(lambda: engine.generate(input_ids=batch_ids, sampling_params=params), clock)
    engine.shutdown()
    row = {
        "dtype": dtype,
        "ours_decode_tok_s": tokens / tot["ours"],
        "hf_decode_tok_s": tokens / tot["hf"] if hf is not None else None,
        f"ours_batch{args.batch}_tok_s": args.batch * n / seconds,
    }
    row["speedup_vs_hf"] = row["ours_decode_tok_s"] / row["hf_decode_tok_s"] if hf is not None else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=5, help="batch-1 prompts (chat template applied)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt; the best one counts")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--batch", type=int, default=16, help="prompts in the throughput run")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="bench_ar.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench_dtype(args, d) for d in args.dtypes]
    tput = f"ours_batch{args.batch}_tok_s"
    print(
        f"\nbatch-1 decode tok/s ({args.clock} clock; greedy, {args.new_tokens} new tokens, {args.prompts} prompts, "
        f"prefill excluded; {torch.get_num_threads()} threads)"
    )
    print(f"{'dtype':<10}{'ours':>10}{'transformers':>14}{'speedup':>10}{f'ours batch {args.batch}':>16}")
    for r in rows:
        hf = f"{r['hf_decode_tok_s']:.1f}" if r["hf_decode_tok_s"] else "-"
        sp = f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] else "-"
        print(f"{r['dtype']:<10}{r['ours_decode_tok_s']:>10.1f}{hf:>14}{sp:>10}{r[tput]:>16.1f}")
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor()}
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "env": meta, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
