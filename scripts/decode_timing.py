"""A short AR vs DFLASH decode timing on one device (a step of scripts/gpu_check.sh).

The test target (the default SmolLM2-135M, or its random stand-in where the GGUF is absent: see
tests/dflash_helpers.py) with a random drafter, DFlash proposals in fixed blocks (no lookup, no adaptive sizes),
so every step drafts and verifies; greedy, `--prompts` chat prompts in one batch, EOS ignored. A warm-up run
first (device start-up, kernel compilation); the timed run includes the one prefill forward.

    python scripts/decode_timing.py --device cuda --out runs/decode_timing.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test target lives there

from dflash_helpers import (  # noqa: E402
    CHAT_PROMPTS,
    chat_ids,
    default_target_config,
    random_drafter_path,
    target_model_path,
)

from sglang_dflash import Engine  # noqa: E402


def timed_generate(engine: Engine, ids: list[list[int]], new_tokens: int) -> dict:
    """Tokens/s of one greedy batch after a warm-up, and DFLASH's mean accept length where it applies."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params=dict(params, max_new_tokens=4))
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    result = {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds}
    accepts = [o["meta_info"]["spec_accept_length"] for o in outs if "spec_accept_length" in o["meta_info"]]
    if accepts:
        result["accept_length"] = sum(accepts) / len(accepts)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    ap.add_argument("--prompts", type=int, default=8, help=f"chat prompts in the batch (at most {len(CHAT_PROMPTS)})")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="DFLASH block size")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()

    common = {"model_path": target_model_path(), "device": args.device, "dtype": args.dtype, "max_total_tokens": 8192}
    modes = {
        "ar": {},
        "dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(random_drafter_path()),
                   "speculative_num_draft_tokens": args.block, "speculative_adaptive": False,
                   "speculative_lookup": False},
    }
    target = "default" if common["model_path"] is None else "random stand-in"
    report: dict = {"device": args.device, "target": f"{target}, {default_target_config().num_hidden_layers} layers",
                    "prompts": args.prompts, "new_tokens": args.new_tokens, "block": args.block}
    for mode, extra in modes.items():
        engine = Engine(**common, **extra)
        try:
            report["dtype"] = str(engine.server_args.torch_dtype)
            report[mode] = timed_generate(engine, chat_ids(engine, CHAT_PROMPTS[: args.prompts]), args.new_tokens)
        finally:
            engine.shutdown()
        print(f"{mode}: {report[mode]}", flush=True)
    report["dflash_over_ar"] = report["dflash"]["tok_per_s"] / report["ar"]["tok_per_s"]
    print(f"DFLASH / AR tokens/s: {report['dflash_over_ar']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
