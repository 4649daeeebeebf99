"""The C++ CPU decode-attention kernel's two paths on one bf16 pool, side by side: bf16 queries take the bf16
dot-product path (AVX512-BF16), the same queries passed as float32 take the float32 tiled path. Shapes of the
default target (9 query / 3 KV heads, head dim 64): decode rows, verify blocks as runs of rows, a prefill chunk.
Prints a table of microseconds per layer and the ratio; writes JSON.

    python scripts/bench_decode_attention.py --out runs/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sglang_dflash.kernels.cpu_extensions import cpu_extension
from sglang_dflash.kernels.decode_attention import decode_attention

KV_HEADS, GROUP, HEAD_DIM, CONTEXT = 3, 3, 64, 1024
# (requests, rows per request, positions before the first row)
CASES = [(1, 1, 400), (16, 1, 400), (32, 1, 400), (16, 2, 400), (16, 9, 400), (1, 16, 400), (1, 256, 300)]


def time_us(args: tuple, repeats: int) -> float:
    """Median of `repeats` timed `decode_attention(*args)` calls after 3 warm-ups."""
    for _ in range(3):
        decode_attention(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode_attention(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    ext = cpu_extension("decode_attention")
    if ext is None or not ext.dot_bf16(HEAD_DIM):
        raise SystemExit("the bf16 dot-product path is not built here (needs the C++ kernel and AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    reqs = max(n for n, _, _ in CASES)
    slots = reqs * CONTEXT
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    table = torch.randperm(slots, generator=gen).view(reqs, CONTEXT)  # the pool's slots in no order, like pages
    rows_out = []
    print("| requests | rows each | context | float32 path us | bf16 dot path us | ratio |\n|---|---|---|---|---|---|")
    for n, per, context in CASES:
        rows = torch.arange(n).repeat_interleave(per)
        lens = (context + 1 + torch.arange(per)).repeat(n)
        q = torch.randn(n * per, KV_HEADS * GROUP, HEAD_DIM, generator=gen).bfloat16()
        rest = (k, v, table, rows, lens, HEAD_DIM**-0.5, CONTEXT)
        f32 = time_us((q.float(), *rest), args.repeats)
        dot = time_us((q, *rest), args.repeats)
        rows_out.append({"requests": n, "rows_each": per, "context": context, "float32_us": f32, "bf16_dot_us": dot})
        print(f"| {n} | {per} | {context} | {f32:.1f} | {dot:.1f} | {f32 / dot:.2f}x |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "cases": rows_out}, indent=1))


if __name__ == "__main__":
    main()
