"""Side by side: SGLang + our DFLASH worker, SGLang without speculation, and our own server (DFLASH and AR).

The same closed-loop sweep as scripts/load_test.py (whose clients, statistics and plot it reuses), one run,
one table and one PNG of output tokens/s vs concurrency:

    python scripts/load_test_sglang.py --draft PATH --concurrency 1,2,4,8,16,32 --num-prompts 64 --max-tokens 256

SGLang runs from the SGLang venv (--sglang-python; on CPU made by scripts/install_sglang_cpu.sh) on the HF
directory of the model (`python -m sglang_dflash.convert`), with --sglang-args (default: the CPU flags).
Every server inherits the environment: on a small or shared CPU set OMP_NUM_THREADS (SGLang's CPU engine is
several times slower when its threads are oversubscribed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import load_test as lt  # noqa: E402

CPU_SGLANG_ARGS = ("--device cpu --attention-backend torch_native --disable-cuda-graph --max-total-tokens 8192 "
                   "--dtype float32 --sleep-on-idle")
TARGETS = ("sglang-dflash", "sglang-ar", "ours-dflash", "ours-ar")


def command(target: str, port: int, args: argparse.Namespace) -> list[str]:
    if target.startswith("ours-"):
        cfg = lt.Config(target, target == "ours-dflash", True)
        return lt.sglang_dflash_command(cfg, port, args)
    cmd = [args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(args.model), "--host", "127.0.0.1",
           "--port", str(port), "--max-running-requests", str(max(args.concurrency)), "--enable-metrics",
           *args.sglang_args.split()]
    if target == "sglang-dflash":
        cmd += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft]
    return cmd


def run_target(target: str, prompts: list[str], args: argparse.Namespace) -> dict[int, dict]:
    port = lt.free_port()
    cmd = command(target, port, args)
    print(f"== {target}: {' '.join(cmd)}", flush=True)
    results = {}
    with lt.running_server(cmd, port, args.out / f"server-{target}.log") as url:
        asyncio.run(lt.closed_loop(url, prompts[:1], 1, args))  # warm-up, not measured
        for c in args.concurrency:
            batch = [prompts[i % len(prompts)] for i in range(max(args.num_prompts, c))]
            before = lt.scrape(url)
            records, wall = asyncio.run(lt.closed_loop(url, batch, c, args))
            results[c] = r = lt.level_stats(records, wall, before, lt.scrape(url))
            print(f"  c={c:<3} {r['output_tok_s']:8.1f} tok/s  ttft p50 {lt.fmt(r['ttft_p50_ms'])} ms  tpot p50 "
                  f"{lt.fmt(r['tpot_p50_ms'])} ms  errors {r['errors']}", flush=True)
    return results


def table(results: dict[str, dict[int, dict]], concurrency: list[int]) -> str:
    names = list(results)
    lines = ["| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for c in concurrency:
        lines.append(f"| {c} | " + " | ".join(f"{results[n][c]['output_tok_s']:.1f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="DFlash drafter checkpoint directory")
    ap.add_argument("--model", type=Path, help="HF model directory for SGLang (default: the converted default GGUF)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of " + ", ".join(TARGETS))
    ap.add_argument("--sglang-python", default=str(REPO / ".venv-sglang" / "bin" / "python"))
    ap.add_argument("--sglang-args", default=CPU_SGLANG_ARGS, help="extra SGLang flags (default: CPU)")
    ap.add_argument("--server-args", default="", help="extra flags for our server")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated client counts")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level (at least C)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--dataset", choices=["mixed", "humaneval", "mtbench"], default="mixed")
    ap.add_argument("--out", type=Path, default=Path("runs/load_test_sglang"))
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    targets = args.targets.split(",")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        ap.error(f"unknown target(s): {', '.join(unknown)}")
    if args.model is None:
        from sglang_dflash.convert import convert

        args.model = convert(None)
    if "--device cpu" in args.sglang_args:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

    args.out.mkdir(parents=True, exist_ok=True)
    prompts = lt.load_prompts(args.dataset)
    results = {t: run_target(t, prompts, args) for t in targets}
    summary = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "results": results, "table": table(results, args.concurrency)}
    (args.out / "load_test_sglang.json").write_text(json.dumps(summary, indent=2))
    lt.plot(results, args.concurrency, args.out / "load_test_sglang.png")
    print(summary["table"])
    print(f"wrote {args.out / 'load_test_sglang.json'} and {args.out / 'load_test_sglang.png'}")


if __name__ == "__main__":
    main()
