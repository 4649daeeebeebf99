"""Rows vs time of the CPU linear layers over one model's worth of layer weights (the default target's shapes,
random bf16 weights): where a verify block stops being free. For each row count M: milliseconds per pass over
every layer's projections, weight GB/s, GFLOP/s, and the time relative to M = 1, for our AVX512-BF16 kernel and
for oneDNN's packed GEMM side by side. Past the rows where GFLOP/s stops growing the CPU's multiply units are the
limit, so a block of that many tokens costs what its multiplications cost, whatever the kernel.

    python scripts/bench_linear.py --rows 1,4,8,12,16,24,32,64 --out runs/bench_linear.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from sglang_dflash.models.packed_linear import PackedLinear, bf16_kernel


def layer_shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections: qkv, o, gate_up, down."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
            (hidden, inter)]


def timed(linears: list[PackedLinear], inputs: dict[int, torch.Tensor], repeats: int) -> float:
    """Best of `repeats` passes over every linear, seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for lin in linears:
            lin(inputs[lin.in_features])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shape", default="576,1536,9,3,64", help="hidden,intermediate,heads,kv_heads,head_dim")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench_linear.json"))
    args = ap.parse_args()
    if bf16_kernel() is None:
        raise SystemExit("the AVX512-BF16 linear kernel is not available on this CPU")
    shapes = layer_shapes(*(int(x) for x in args.shape.split(","))) * args.layers
    torch.manual_seed(0)
    plain = [nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for n, k in shapes]
    ours = [PackedLinear(lin) for lin in plain]
    onednn = []
    for lin in plain:
        packed = PackedLinear(lin)
        packed.onednn = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
        packed.onednn_from_rows = 0
        onednn.append(packed)
    params = sum(n * k for n, k in shapes)
    rows_list = [int(x) for x in args.rows.split(",")]
    results, base = [], {}
    print(f"{params / 1e6:.1f} M weights ({2 * params / 1e6:.0f} MB bf16), {torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'kernel':>7} {'ms':>7} {'GB/s':>6} {'GFLOP/s':>8} {'x M=1':>6}")
    with torch.inference_mode():
        for m in rows_list:
            inputs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
            for name, linears in (("ours", ours), ("onednn", onednn)):
                timed(linears, inputs, 1)  # warm-up
                s = timed(linears, inputs, args.repeats)
                base.setdefault(name, s)
                row = {"rows": m, "kernel": name, "ms": s * 1e3, "weight_gb_s": 2 * params / s / 1e9,
                       "gflop_s": 2 * params * m / s / 1e9, "vs_one_row": s / base[name]}
                results.append(row)
                print(f"{m:>5} {name:>7} {row['ms']:>7.2f} {row['weight_gb_s']:>6.1f} {row['gflop_s']:>8.1f} "
                      f"{row['vs_one_row']:>6.2f}", flush=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "weights": params, "results": results},
                                   indent=2))


if __name__ == "__main__":
    main()
