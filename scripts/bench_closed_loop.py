"""Offline closed loop: AR and DFLASH engines in one process, stepped in turns, each keeping C requests in flight.

Both engines see the same prompts (mixed HumanEval / MT-Bench chats, greedy) and the same drifts of a shared
machine, step by step, so their ratio is steadier than two servers'. Prints output tokens/s of each, the
ratio, the decode steps' mean time and tokens, the decode steps by the number of requests running (the batch
shrinks in a drain), and per proposal source the drafts the policy expected against those accepted; writes JSON.
With --requests N each engine issues N requests in all and runs until they finish: a load test's level (ramp,
C in flight, drain) in process, every step counted.

  python scripts/bench_closed_loop.py --concurrency 32 --steps 200 --draft random
  python scripts/bench_closed_loop.py --concurrency 32 --requests 128 --max-tokens 128   # one load-test level
  python scripts/bench_closed_loop.py --configs ar,dflash,ar+mixed,dflash+mixed   # --enable-mixed-chunk too
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests")]
from dflash_helpers import default_target_config, save_random_drafter  # noqa: E402
from load_test import load_prompts  # noqa: E402

from sglang_dflash import Engine  # noqa: E402
from sglang_dflash.scheduler.schedule_batch import Req  # noqa: E402
from sglang_dflash.speculative.policy import NONE, SpecPolicy  # noqa: E402

WARMUP_STEPS = 10
BATCH_BUCKETS = (1, 4, 8, 16, 24, 32)  # decode steps grouped by the requests running: [1, 4), [4, 8), ...
CONFIGS = {"ar": {"speculative_algorithm": "NONE"}, "dflash": {"speculative_algorithm": "DFLASH"},
           "ar+mixed": {"speculative_algorithm": "NONE", "enable_mixed_chunk": True},
           "dflash+mixed": {"speculative_algorithm": "DFLASH", "enable_mixed_chunk": True}}


def watch_policy(policy: SpecPolicy) -> dict[str, list[float]]:
    """Per estimate key: [proposals, drafts expected, drafts accepted], filled as the policy observes steps."""
    seen: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    observe = policy.observe

    def observed(states, plans, accepted) -> None:
        for st, plan, a in zip(states, plans, accepted):
            if plan.source != NONE:
                row = seen[plan.key]
                row[0] += 1
                row[1] += sum(policy.gains(st, plan.key, plan.block_len - 1))
                row[2] += a
        observe(states, plans, accepted)

    policy.observe = observed
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--requests", type=int, default=0,
                    help="issue this many requests per engine, then drain (instead of --steps in a steady state)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default=None, help="drafter directory, 'random', or the shipped one (default)")
    ap.add_argument("--configs", default="ar,dflash",
                    help=f"comma-separated, the first is the baseline: {', '.join(CONFIGS)}")
    ap.add_argument("--out", type=Path, default=Path("bench_closed_loop.json"))
    args = ap.parse_args()
    draft = args.draft
    if draft == "random":
        draft = str(save_random_drafter(Path(tempfile.mkdtemp()) / "random", default_target_config()))
    common = {"max_running_requests": max(32, args.concurrency), "log_level": "warning"}
    names = args.configs.split(",")
    engines = {name: Engine(**CONFIGS[name], **common, **({"speculative_draft_model_path": draft}
                                                          if "dflash" in name else {})) for name in names}
    seen = {name: watch_policy(engines[name].scheduler.worker.step.policy) for name in names if "dflash" in name}
    prompts = load_prompts("mixed")
    live: dict[str, list[Req]] = {name: [] for name in engines}
    next_prompt = dict.fromkeys(engines, 0)
    totals = {name: defaultdict(float) for name in engines}
    by_batch = {name: defaultdict(lambda: [0, 0.0, 0]) for name in engines}  # bucket -> [steps, seconds, tokens]
    issued = dict.fromkeys(engines, 0)
    drain, warmup = args.requests > 0, 0 if args.requests > 0 else WARMUP_STEPS
    step = 0
    while (any(live.values()) or step == 0) if drain else step < args.steps:
        step += 1
        for name, engine in engines.items():
            tm, sched = engine.tokenizer_manager, engine.scheduler
            while len(live[name]) < args.concurrency and (not drain or issued[name] < args.requests):
                ids = tm.chat_ids([{"role": "user", "content": prompts[next_prompt[name] % len(prompts)]}])
                next_prompt[name] += 1
                issued[name] += 1
                req = tm.make_req(None, ids, {"max_new_tokens": args.max_tokens, "temperature": 0})
                sched.add_request(req)
                live[name].append(req)
            if not live[name]:
                continue
            before = sum(len(r.output_ids) for r in live[name])
            running = sum(1 for r in live[name] if r.output_ids)
            start = time.perf_counter()
            sched.run_step()
            seconds = time.perf_counter() - start
            tokens = sum(len(r.output_ids) for r in live[name]) - before
            prefill = sum(1 for r in live[name] if r.output_ids) > running  # new requests got their first token
            live[name] = [r for r in live[name] if not r.finished()]
            if step > warmup:
                t = totals[name]
                t["seconds"] += seconds
                t["tokens"] += tokens
                t["steps"] += 1
                if not prefill:
                    t["decode_steps"] += 1
                    t["decode_seconds"] += seconds
                    t["decode_tokens"] += tokens
                    bucket = by_batch[name][max(b for b in BATCH_BUCKETS if b <= max(running, 1))]
                    bucket[0], bucket[1], bucket[2] = bucket[0] + 1, bucket[1] + seconds, bucket[2] + tokens
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    base_tok_s = totals[names[0]]["tokens"] / totals[names[0]]["seconds"]
    for name, t in totals.items():
        result[name] = {"tok_s": t["tokens"] / t["seconds"], "decode_step_ms": 1000 * t["decode_seconds"] /
                        max(t["decode_steps"], 1), "decode_tokens_per_step": t["decode_tokens"] /
                        max(t["decode_steps"], 1), "other_steps": t["steps"] - t["decode_steps"],
                        "ratio": t["tokens"] / t["seconds"] / base_tok_s, "seconds": t["seconds"],
                        "by_batch": {f"{b}+": {"steps": n, "seconds": sec, "tokens": tok}
                                     for b, (n, sec, tok) in sorted(by_batch[name].items())}}
        print(f"{name:13s} {result[name]['tok_s']:7.1f} tok/s {result[name]['ratio']:6.3f}x  {t['seconds']:.1f} s, "
              f"decode step {result[name]['decode_step_ms']:6.1f} ms, {result[name]['decode_tokens_per_step']:5.1f} "
              f"tokens; {result[name]['other_steps']:.0f} other steps")
    print("decode steps by requests running: steps, seconds, tokens (tok/s)")
    for b in BATCH_BUCKETS:
        if not any(f"{b}+" in result[name]["by_batch"] for name in names):
            continue
        cells = []
        for name in names:
            row = result[name]["by_batch"].get(f"{b}+")
            cells.append(f"{name} {row['steps']} {row['seconds']:.2f} s {row['tokens']} "
                         f"({row['tokens'] / row['seconds']:.0f})" if row else f"{name} -")
        print(f"  {b:2d}+: " + " | ".join(cells))
    for name, watched in seen.items():
        result[name]["sources"] = {k: {"proposals": n, "expected": e / n, "accepted": a / n}
                                   for k, (n, e, a) in watched.items()}
        print(name)
        for key, row in sorted(result[name]["sources"].items()):
            print(f"  {key:8s} {row['proposals']:5d} proposals, drafts expected {row['expected']:.2f}, "
                  f"accepted {row['accepted']:.2f}")
    args.out.write_text(json.dumps(result, indent=1))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
