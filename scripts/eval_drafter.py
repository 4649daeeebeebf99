"""Does the drafter use its context? Teacher-forced diagnostics of DFlash drafters on held-out greedy responses
of the target, against the baselines a drafter must beat.

From every position of each response (the block [x_a, MASK, ...] over the target's features of x_<a), the
drafter's greedy drafts are compared with the response: per block position k the marginal acceptance (the
share of blocks whose accepted run reaches k), the conditional one (reaches k given it reached k - 1) and
teacher-forced tau (accepted + 1). The same for
- ablations: the context features zeroed, and each target layer's features zeroed in turn;
- trigram: the most frequent next token after the last two, counted from the training responses;
- lookup: the engine's context lookup (longest suffix n-gram earlier in prompt + response);
- lookup+drafter: lookup where a suffix matches, else the (first) drafter;
and, with --worker N, tau of the real DFlashWorker on the first N prompts (fixed full block, no lookup, batched
greedy decode).

Datasets: `responses` = the greedy records of the hash dev split of --data (no training run sees them);
`humaneval` / `mtbench` = the target's greedy responses to the first prompts, generated here. `name:N` takes N
prompts of a dataset (default --num-prompts).

    python scripts/eval_drafter.py --dataset responses,humaneval:40,mtbench:80 --worker 20
    python scripts/eval_drafter.py --draft runs/a/latest --draft runs/b/latest --dataset humaneval --no-ablations
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_speculative import load_prompts

from sglang_dflash import Engine
from sglang_dflash.runtime.model_runner import ModelRunner
from sglang_dflash.server_args import ServerArgs
from sglang_dflash.speculative.drafter import DEFAULT_DRAFTER, load_drafter
from sglang_dflash.training.baselines import TrigramModel, lookup_runs
from sglang_dflash.training.data import is_dev_record
from sglang_dflash.training.datagen import load_shards
from sglang_dflash.training.evaluate import acceptance_summary, drafter_runs
from sglang_dflash.training.features import target_features

REPO = Path(__file__).resolve().parent.parent
SHOWN_POSITIONS = 6
MIN_PLOTTED = 20  # a conditional acceptance is plotted where at least this many blocks reached k - 1


def greedy_sequences(dataset: str, count: int, args, records: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy response ids) of the first `count` prompts of one dataset."""
    if dataset == "responses":
        dev = [r for r in records if is_dev_record(r["id"]) and r["sampling"].get("temperature", 1.0) == 0]
        dev = dev[:count]
        return [r["prompt_ids"] for r in dev], [r["response_ids"][: args.max_new_tokens] for r in dev]
    engine = Engine(model_path=args.model_path, dtype=args.dtype, device=args.device, max_running_requests=16)
    try:
        prompts = [engine.tokenizer_manager.chat_ids([{"role": "user", "content": p}])
                   for p in load_prompts(dataset, count)]
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                                   "max_new_tokens": args.max_new_tokens})
    finally:
        engine.shutdown()
    return prompts, [o["output_ids"] for o in outs]


def worker_tau(draft: Path, prompts: list[list[int]], args) -> float:
    """Mean over requests of the real worker's committed tokens per verify step (full block, no lookup)."""
    engine = Engine(model_path=args.model_path, dtype=args.dtype, device=args.device, max_running_requests=8,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                    speculative_adaptive=False, speculative_lookup=False)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                                   "max_new_tokens": args.max_new_tokens})
    finally:
        engine.shutdown()
    return sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs)


def evaluate_dataset(
    dataset: str, count: int, args, records: list[dict], runner: ModelRunner, drafters: dict, trigram: TrigramModel
) -> dict:
    prompts, responses = greedy_sequences(dataset, count, args, records)
    first = next(iter(drafters.values()))
    block = first.config.block_size
    runs: dict[str, list[torch.Tensor]] = {}

    def add(name: str, value: torch.Tensor) -> None:
        runs.setdefault(name, []).append(value.cpu())

    if not any(len(r) >= 2 for r in responses):
        raise SystemExit(f"{dataset}: no responses of 2 tokens or more to evaluate")
    for prompt, response in zip(prompts, responses):
        ids = prompt + response
        if len(response) < 2:
            continue
        feats: dict[tuple[int, ...], torch.Tensor] = {}
        for name, draft in drafters.items():
            layers = tuple(draft.config.target_layer_ids)
            if layers not in feats:
                feats[layers] = target_features(runner, [ids], layers)[0]
            f = feats[layers]
            stride = args.anchor_stride
            add(name, drafter_runs(draft, f, ids, len(prompt), stride))
            if args.ablations:
                add(f"{name} / context zeroed", drafter_runs(draft, torch.zeros_like(f), ids, len(prompt), stride))
                width = f.shape[1] // len(layers)
                for j, layer in enumerate(layers):
                    masked = f.clone()
                    masked[:, j * width : (j + 1) * width] = 0
                    add(f"{name} / layer {layer} zeroed", drafter_runs(draft, masked, ids, len(prompt), stride))
        add("trigram", trigram.runs(ids, len(prompt), block)[:: args.anchor_stride])
        lookup, match = lookup_runs(ids, len(prompt), block, args.lookup_min_match, args.lookup_max_match)
        lookup, match = lookup[:: args.anchor_stride], match[:: args.anchor_stride]
        add("lookup", lookup)
        add(f"lookup+{next(iter(drafters))}", torch.where(match > 0, lookup, runs[next(iter(drafters))][-1]))
    out = {"dataset": dataset, "sequences": len(runs["trigram"]), "block_size": block,
           "proposers": {name: acceptance_summary(torch.cat(r), block) for name, r in runs.items()}}
    if args.worker:
        out["worker_prompts"] = min(args.worker, len(prompts))
        for name, path in zip(drafters, args.draft):
            out["proposers"][name]["worker_tau"] = worker_tau(path, prompts[: args.worker], args)
    return out


def print_table(result: dict) -> None:
    k = SHOWN_POSITIONS
    note = f", worker tau on the first {result['worker_prompts']}" if "worker_prompts" in result else ""
    print(f"\n{result['dataset']}: {result['sequences']} greedy responses, block {result['block_size']}{note}")
    print(f"| proposer | anchors | tau (teacher-forced) | tau (worker) | conditional acceptance k=1..{k} | "
          f"marginal k=1..{k} |")
    print("|---|---|---|---|---|---|")
    for name, s in result["proposers"].items():
        worker = f"{s['worker_tau']:.2f}" if "worker_tau" in s else "-"
        cond = " ".join(f"{c:.2f}" for c in s["conditional"][:k])
        reach = " ".join(f"{r:.2f}" for r in s["reach"][:k])
        print(f"| {name} | {s['anchors']} | {s['tau']:.3f} | {worker} | {cond} | {reach} |")


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        for name, s in result["proposers"].items():
            if " zeroed" in name and "context" not in name:
                continue  # the per-layer ablations are in the table
            reached = [s["anchors"], *(r * s["anchors"] for r in s["reach"][:-1])]  # blocks that reached k - 1
            shown = [c if n >= MIN_PLOTTED else float("nan") for c, n in zip(s["conditional"], reached)]
            ax.plot(range(1, len(shown) + 1), shown, marker="o", ms=3, label=f"{name} (tau {s['tau']:.2f})")
        ax.set_title(f"{result['dataset']} ({result['sequences']} responses)")
        ax.set_xlabel("block position k")
        ax.set_ylabel(f"acceptance at k given k-1 accepted (>= {MIN_PLOTTED} blocks)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, action="append", help="drafter directory (repeatable; default: shipped)")
    ap.add_argument("--dataset", default="responses,humaneval,mtbench", help="comma-separated, each name[:N]")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "responses",
                    help="training responses (trigram, dev)")
    ap.add_argument("--anchor-stride", type=int, default=1, help="every k-th response position only (k x faster)")
    ap.add_argument("--no-ablations", dest="ablations", action="store_false")
    ap.add_argument("--worker", type=int, default=0, metavar="N",
                    help="also the real worker's tau on the first N prompts (full block, no lookup)")
    ap.add_argument("--lookup-min-match", type=int, default=ServerArgs.speculative_lookup_min_match)
    ap.add_argument("--lookup-max-match", type=int, default=ServerArgs.speculative_lookup_max_match)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("eval_drafter.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args()
    args.draft = args.draft or [DEFAULT_DRAFTER]
    datasets = [(name, int(n) if n else args.num_prompts) for name, _, n in
                (d.partition(":") for d in args.dataset.split(","))]
    if unknown := {name for name, _ in datasets} - {"responses", "humaneval", "mtbench"}:
        raise SystemExit(f"unknown datasets {sorted(unknown)}")
    server = ServerArgs(model_path=args.model_path, dtype=args.dtype, device=args.device)
    args.dtype = str(server.torch_dtype).removeprefix("torch.")

    records = load_shards(args.data)
    if not records:
        raise SystemExit(f"no training responses under {args.data} (the trigram baseline counts them)")
    trigram = TrigramModel([r["response_ids"] for r in records if not is_dev_record(r["id"])])
    device = torch.device(args.device)
    longest = args.max_new_tokens + 2048
    runner = ModelRunner(args.model_path, device, server.torch_dtype, longest + 64, 2)
    head, embed = runner.model.lm_head, runner.model.model.embed_tokens
    names = [p.name if p.name != "latest" else p.parent.name for p in args.draft]
    if len(set(names)) < len(names):
        names = [str(p) for p in args.draft]
    drafters = {n: load_drafter(p, device, server.torch_dtype, runner.model_config, embed, head)
                for n, p in zip(names, args.draft)}
    results = []
    for dataset, count in datasets:
        results.append(evaluate_dataset(dataset, count, args, records, runner, drafters, trigram))
        print_table(results[-1])
    args.out.write_text(json.dumps({"drafters": dict(zip(names, map(str, args.draft))), "dtype": args.dtype,
                                    "max_new_tokens": args.max_new_tokens, "results": results}, indent=2))
    png = args.plot or args.out.with_suffix(".png")
    plot(png, results)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
