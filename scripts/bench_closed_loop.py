"""Offline closed loop: AR and DFLASH engines in one process, stepped in turns, each keeping C requests in flight.

Both engines see the same prompts (mixed HumanEval / MT-Bench chats, greedy) and the same drifts of a shared
machine, step by step, so their ratio is steadier than two servers'. Prints output tokens/s of each, the
ratio, the decode steps' mean time and tokens, and per proposal source the drafts the policy expected against
those accepted; writes JSON.

  python scripts/bench_closed_loop.py --concurrency 32 --steps 200 --draft random
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
    for step in range(args.steps):
        for name, engine in engines.items():
            tm, sched = engine.tokenizer_manager, engine.scheduler
            while len(live[name]) < args.concurrency:
                ids = tm.chat_ids([{"role": "user", "content": prompts[next_prompt[name] % len(prompts)]}])
                next_prompt[name] += 1
                req = tm.make_req(None, ids, {"max_new_tokens": args.max_tokens, "temperature": 0})
                sched.add_request(req)
                live[name].append(req)
            before = sum(len(r.output_ids) for r in live[name])
            start = time.perf_counter()
            sched.run_step()
            seconds = time.perf_counter() - start
            tokens = sum(len(r.output_ids) for r in live[name]) - before
            live[name] = [r for r in live[name] if not r.finished()]
            if step >= WARMUP_STEPS:
                t = totals[name]
                t["seconds"] += seconds
                t["tokens"] += tokens
                t["steps"] += 1
                if tokens >= args.concurrency // 2:  # a decode step (prefill steps add a token per new request)
                    t["decode_steps"] += 1
                    t["decode_seconds"] += seconds
                    t["decode_tokens"] += tokens
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    base_tok_s = totals[names[0]]["tokens"] / totals[names[0]]["seconds"]
    for name, t in totals.items():
        result[name] = {"tok_s": t["tokens"] / t["seconds"], "decode_step_ms": 1000 * t["decode_seconds"] /
                        max(t["decode_steps"], 1), "decode_tokens_per_step": t["decode_tokens"] /
                        max(t["decode_steps"], 1), "other_steps": t["steps"] - t["decode_steps"],
                        "ratio": t["tokens"] / t["seconds"] / base_tok_s}
        print(f"{name:13s} {result[name]['tok_s']:7.1f} tok/s {result[name]['ratio']:6.3f}x  decode step "
              f"{result[name]['decode_step_ms']:6.1f} ms, {result[name]['decode_tokens_per_step']:5.1f} tokens; "
              f"{result[name]['other_steps']:.0f} other steps")
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
