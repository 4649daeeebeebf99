"""Soak test: N closed-loop clients for T seconds against one server, then a KV leak check.

Every client sends its next request as soon as its previous one ends, each drawn at random (seeded): chat or
completions, streaming or not, greedy or sampled, short or long max_tokens; each under a client timeout (a
request past it is cancelled: the client disconnects and the server must abort it). Outcomes are counted
apart: successes, failures (an HTTP error other than 503, an error event, a malformed or cut-off response),
client timeouts, and fast 503 refusals (the admission bound; the client waits Retry-After). Afterwards the
server must go idle with its KV pool back to the baseline taken before the run (/get_server_info
`available_kv_tokens`, both after /flush_cache) and still serve. Prints a table and writes JSON; exits 1 on
any failure or a KV leak.

    python scripts/soak_test.py --algorithm DFLASH          # starts the server (default model + drafter)
    python scripts/soak_test.py --algorithm NONE
    python scripts/soak_test.py --url http://127.0.0.1:30000 --api-key KEY   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import running_server  # noqa: E402
from server_helpers import PROMPTS, free_port  # noqa: E402  (load_test puts tests/ on the path)

OUTCOMES = ("ok", "failed", "timeout", "refused")


@dataclass(frozen=True)
class Kind:
    endpoint: str  # chat | completions
    stream: bool
    sampled: bool
    long: bool

    @property
    def name(self) -> str:
        return "/".join((self.endpoint, "stream" if self.stream else "plain", "sampled" if self.sampled else "greedy",
                         "long" if self.long else "short"))


@dataclass
class Record:
    kind: str
    outcome: str  # one of OUTCOMES
    latency_s: float
    tokens: int = 0
    error: str | None = None


# ---- one request ----
def draw(rng: random.Random, args: argparse.Namespace) -> tuple[Kind, str, dict]:
    kind = Kind(rng.choice(("chat", "completions")), rng.random() < 0.5, rng.random() < 0.5,
                rng.random() < args.long_fraction)
    prompt = rng.choice(PROMPTS)
    body: dict = {"model": "default", "stream": kind.stream,
                  "max_tokens": rng.randint(args.long_tokens // 2, args.long_tokens) if kind.long
                  else rng.randint(1, args.short_tokens)}
    if kind.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind.stream:
        body["stream_options"] = {"include_usage": True}
    body.update({"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31)} if kind.sampled
                else {"temperature": 0})
    return kind, f"/v1/{'chat/completions' if kind.endpoint == 'chat' else 'completions'}", body


def check_choice(choice: dict) -> str | None:
    if choice.get("finish_reason") not in ("stop", "length"):
        return f"finish_reason {choice.get('finish_reason')!r}"
    return None


async def send(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, int, str | None, float]:
    """(outcome, completion tokens, error, Retry-After) of one request, without the client timeout."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code == 503:
            await r.aread()
            return "refused", 0, None, float(r.headers.get("Retry-After", 1))
        if r.status_code != 200:
            return "failed", 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}", 0.0
        if not body["stream"]:
            data = json.loads(await r.aread())
            error = check_choice(data["choices"][0])
            return ("failed" if error else "ok"), data["usage"]["completion_tokens"], error, 0.0
        tokens, finished, done = 0, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "failed", tokens, f"error event: {event['error'].get('message')}", 0.0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    finished = choice
        error = ("stream ended without [DONE]" if not done else "no finish_reason" if finished is None
                 else check_choice(finished) or (None if tokens else "no usage chunk"))
        return ("failed" if error else "ok"), tokens, error, 0.0


async def one_request(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace) -> Record:
    kind, path, body = draw(rng, args)
    start = time.perf_counter()
    retry_after = 0.0
    try:
        outcome, tokens, error, retry_after = await asyncio.wait_for(send(client, path, body), args.client_timeout)
    except asyncio.TimeoutError:
        outcome, tokens, error = "timeout", 0, None
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        outcome, tokens, error = "failed", 0, f"{type(e).__name__}: {e}"
    record = Record(kind.name, outcome, time.perf_counter() - start, tokens, error)
    if retry_after:
        await asyncio.sleep(retry_after)
    return record


async def soak(url: str, headers: dict, args: argparse.Namespace) -> tuple[list[Record], float]:
    records: list[Record] = []
    stop_at = time.perf_counter() + args.duration

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + i)
        while time.perf_counter() < stop_at:
            records.append(await one_request(client, rng, args))

    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(None), limits=limits) as c:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(c, i) for i in range(args.clients)))
        return records, time.perf_counter() - start


# ---- the server after the run ----
def idle_kv(url: str, headers: dict, timeout: float = 120) -> dict:
    """/get_server_info once no request is left, after /flush_cache (a prefix cache may hold KV)."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    httpx.post(f"{url}/flush_cache", headers=headers, timeout=30)
    return httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()


def still_serves(url: str, headers: dict) -> bool:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- report ----
def summarise(records: list[Record]) -> dict:
    counts = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    ok = [r.latency_s for r in records if r.outcome == "ok"]
    refused = [r.latency_s for r in records if r.outcome == "refused"]

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) if xs else None

    return {"requests": len(records), **counts, "output_tokens": sum(r.tokens for r in records if r.outcome == "ok"),
            "latency_p50_s": pct(ok, 50), "latency_p99_s": pct(ok, 99), "refusal_p99_s": pct(refused, 99)}


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(by_kind: dict[str, dict], total: dict) -> str:
    head = "| kind | requests | ok | failed | client timeouts | 503 refusals | p50 s | p99 s | tokens |"
    lines = [head, "|---" * 9 + "|"]
    for name, s in [*sorted(by_kind.items()), ("TOTAL", total)]:
        lines.append(f"| {name} | {s['requests']} | {s['ok']} | {s['failed']} | {s['timeout']} | {s['refused']} | "
                     f"{fmt(s['latency_p50_s'])} | {fmt(s['latency_p99_s'])} | {s['output_tokens']} |")
    return "\n".join(lines)


def run(url: str, args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    before = idle_kv(url, headers)
    print(f"soak: {args.clients} clients for {args.duration:g}s against {url} "
          f"({before.get('speculative_algorithm') or 'NONE'}), client timeout {args.client_timeout:g}s", flush=True)
    records, wall = asyncio.run(soak(url, headers, args))
    after = idle_kv(url, headers)
    total = summarise(records)
    total["output_tok_s"] = total["output_tokens"] / wall
    by_kind = {k: summarise([r for r in records if r.kind == k]) for k in sorted({r.kind for r in records})}
    kv = {"baseline_available": before["available_kv_tokens"], "after_available": after["available_kv_tokens"],
          "max_total_num_tokens": after["max_total_num_tokens"], "idle_after": after["num_running_reqs"] == 0
          and after["num_waiting_reqs"] == 0}
    kv["back_to_baseline"] = kv["idle_after"] and kv["after_available"] == kv["baseline_available"]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "url": url,
            "wall_s": wall, "total": total, "by_kind": by_kind, "kv": kv, "still_serves": still_serves(url, headers),
            "errors": dict(sorted(errors.items(), key=lambda kv_: -kv_[1])[:20]),
            "server": {k: after.get(k) for k in ("speculative_algorithm", "disable_overlap_schedule",
                                                 "max_running_requests", "max_queued_requests", "dtype", "device")},
            "records": [asdict(r) for r in records] if args.keep_records else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on a free port of 127.0.0.1)")
    ap.add_argument("--api-key", help="for --url: the server's --api-key")
    ap.add_argument("--algorithm", type=str.upper, choices=["DFLASH", "NONE"], default="DFLASH",
                    help="--speculative-algorithm of the server started here (DFLASH: the shipped drafter)")
    ap.add_argument("--server-args", default="", help="extra flags for the server started here")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds during which clients send requests")
    ap.add_argument("--client-timeout", type=float, default=120.0, help="seconds before a client gives up")
    ap.add_argument("--short-tokens", type=int, default=16, help="short requests: max_tokens in [1, this]")
    ap.add_argument("--long-tokens", type=int, default=256, help="long requests: max_tokens in [this / 2, this]")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-records", action="store_true", help="every request's record in the JSON")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: runs/soak/soak-<algorithm>.json)")
    args = ap.parse_args()
    name = "url" if args.url else args.algorithm.lower()
    out = args.out or Path("runs/soak") / f"soak-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.url:
        result = run(args.url.rstrip("/"), args)
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_dflash.launch_server", "--speculative-algorithm", args.algorithm,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.server_args.split()]
        print("server:", " ".join(cmd), flush=True)
        with running_server(cmd, port, out.with_suffix(".server.log")) as url:
            result = run(url, args)
    out.write_text(json.dumps(result, indent=2))
    total, kv = result["total"], result["kv"]
    print(table(result["by_kind"], total))
    print(f"{total['requests']} requests in {result['wall_s']:.1f}s: {total['ok']} ok, {total['failed']} failed, "
          f"{total['timeout']} client timeouts, {total['refused']} fast 503 refusals (p99 "
          f"{fmt(total['refusal_p99_s'])} s); {total['output_tok_s']:.1f} output tok/s")
    print(f"KV: {kv['after_available']} / {kv['max_total_num_tokens']} tokens free after (baseline "
          f"{kv['baseline_available']}): {'OK' if kv['back_to_baseline'] else 'LEAK'}; still serves: "
          f"{result['still_serves']}")
    for error, n in result["errors"].items():
        print(f"  {n} x {error}")
    print(f"wrote {out}")
    sys.exit(0 if total["failed"] == 0 and kv["back_to_baseline"] and result["still_serves"] else 1)


if __name__ == "__main__":
    main()
