"""Micro-benchmark each DFlash kernel against its torch reference at serving shapes.

On cuda/xpu both backends are timed with triton.testing.do_bench (median) and their outputs compared;
on cpu only the torch references run, timed with time.perf_counter. Prints a table, optionally JSON.

    python scripts/bench_kernels.py --device cuda --out runs/kernels.json
    python scripts/bench_kernels.py --device cpu --batch 1,8 --vocab 32000
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sglang_dflash import device as dev
from sglang_dflash.kernels import (
    greedy_accept_torch,
    materialize_draft_kv_torch,
    sampling_accept_torch,
    triton_available,
)
from sglang_dflash.kernels.decode_attention import decode_attention_torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 5, 8, 128, 16
Case = tuple[str, str, Callable[[], object], Callable[[], object] | None]


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cpu":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times: list[float] = []
    budget = time.perf_counter() + 0.5
    while len(times) < 5 or (time.perf_counter() < budget and len(times) < 100):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def same(a: object, b: object) -> bool:
    """Exact for integer outputs, rel err < 1e-2 for (bf16) float outputs."""
    if isinstance(a, tuple | list):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()).item())


def materialize_case(n: int, device: torch.device, triton: bool) -> Case:
    kv = torch.randn(n, LAYERS, 2, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    weight = torch.rand(LAYERS, HEAD_DIM, device=device, dtype=torch.bfloat16) + 0.5
    positions = torch.randint(0, 8192, (n,), device=device)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
    freqs = torch.outer(torch.arange(8192, device=device).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slots = max(8192, 2 * n)
    loc = torch.randperm(slots, device=device)[:n]
    pools = [
        torch.zeros(LAYERS, slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(4)
    ]

    def run(fn: Callable, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Callable[[], object]:
        def call() -> tuple[torch.Tensor, torch.Tensor]:
            fn(kv, weight, positions, cos_sin, HEAD_DIM, 1e-6, k_buf, v_buf, loc)
            return k_buf[:, loc], v_buf[:, loc]

        return call

    fast = None
    if triton:
        from sglang_dflash.kernels.draft_kv_triton import materialize_draft_kv_triton

        fast = run(materialize_draft_kv_triton, pools[2], pools[3])
    return (
        "materialize_draft_kv",
        f"N={n} L={LAYERS} nKV={KV_HEADS} hd={HEAD_DIM}",
        run(materialize_draft_kv_torch, pools[0], pools[1]),
        fast,
    )


def greedy_case(bs: int, device: torch.device, triton: bool) -> Case:
    target = torch.randint(0, 1000, (bs, BLOCK), device=device)
    drafts = torch.where(torch.rand(bs, BLOCK - 1, device=device) < 0.8, target[:, :-1], 0)
    candidates = torch.cat([target[:, :1], drafts], dim=1)
    block_lens = torch.full((bs,), BLOCK, device=device)
    args = (candidates, target, block_lens)
    fast = None
    if triton:
        from sglang_dflash.kernels.greedy_triton import greedy_accept_triton

        fast = lambda: greedy_accept_triton(*args)
    return "greedy_accept", f"bs={bs} B={BLOCK}", lambda: greedy_accept_torch(*args), fast


def sampling_case(bs: int, vocab: int, device: torch.device, triton: bool) -> Case:
    p = torch.softmax(torch.randn(bs, BLOCK, vocab, device=device) * 4, dim=-1)
    drafts = p.argmax(dim=-1)
    candidates = torch.cat([drafts[:, :1], drafts[:, :-1]], dim=1)
    block_lens = torch.full((bs,), BLOCK, device=device)
    uniforms = torch.rand(bs, BLOCK + 1, device=device)  # the column views the workers pass
    args = (p, candidates, block_lens, uniforms[:, :BLOCK], uniforms[:, BLOCK])
    fast = None
    if triton:
        from sglang_dflash.kernels.sampling_triton import sampling_accept_triton

        fast = lambda: sampling_accept_triton(*args)
    return "sampling_accept", f"bs={bs} B={BLOCK} V={vocab}", lambda: sampling_accept_torch(*args), fast


def decode_attention_case(bs: int, context: int, device: torch.device, triton: bool) -> Case:
    """One layer's decode attention of bs rows over `context` positions each, 4 query heads per KV head, the
    rows' slots scattered over a pool of 2x the tokens."""
    pool = 2 * bs * context
    k_cache, v_cache = torch.randn(2, pool, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    table = torch.randperm(pool, device=device)[: bs * context].view(bs, context).to(torch.int32)
    rows = torch.arange(bs, device=device)
    seq_lens = torch.full((bs,), context, device=device)
    q = torch.randn(bs, 4 * KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, table, rows, seq_lens, HEAD_DIM**-0.5)
    fast = None
    if triton:
        from sglang_dflash.kernels.decode_attention_triton import decode_attention_triton

        fast = lambda: decode_attention_triton(*args)
    return ("decode_attention", f"bs={bs} ctx={context} nKV={KV_HEADS} g=4 hd={HEAD_DIM}",
            lambda: decode_attention_torch(*args, context), fast)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or xpu")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tokens", default="16,128,512", help="token counts N for materialize_draft_kv")
    parser.add_argument("--batch", default="1,8,32,64", help="batch sizes for the per-request kernels")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--context", type=int, default=1024, help="positions per row for decode_attention")
    args = parser.parse_args()
    device = dev.resolve_device(args.device)
    triton = device.type != "cpu" and triton_available()
    torch.manual_seed(0)
    cases: list[Callable[[], Case]] = [
        lambda n=n: materialize_case(n, device, triton) for n in map(int, args.tokens.split(","))
    ]
    for bs in map(int, args.batch.split(",")):
        cases += [
            lambda bs=bs: greedy_case(bs, device, triton),
            lambda bs=bs: sampling_case(bs, args.vocab, device, triton),
            lambda bs=bs: decode_attention_case(bs, args.context, device, triton),
        ]
    rows = []
    print(f"{'kernel':<22} {'shape':<32} {'torch ms':>9} {'triton ms':>9} {'speedup':>7}  match")
    for make in cases:
        name, shape, ref, fast = make()
        row = {"kernel": name, "shape": shape, "torch_ms": time_ms(ref, device)}
        if fast is not None:
            row["triton_ms"] = time_ms(fast, device)
            row["speedup"] = row["torch_ms"] / row["triton_ms"]
            row["match"] = same(fast(), ref())
        rows.append(row)
        fast_cols = (
            f"{row['triton_ms']:>9.4f} {row['speedup']:>6.2f}x  {row['match']}" if fast else f"{'-':>9}"
        )
        print(f"{name:<22} {shape:<32} {row['torch_ms']:>9.4f} {fast_cols}", flush=True)
        del ref, fast
        dev.empty_cache(device)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": str(device), "torch": torch.__version__, "triton_used": triton}
        args.out.write_text(json.dumps({**meta, "results": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
