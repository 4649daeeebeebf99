"""How held-out tau grows with training data: one drafter trained from scratch per data size, same recipe.

The sizes are nested subsets of the training records (one fixed shuffle, the hash dev split left out), each
trained for `--epochs` passes over its subset (steps = size x epochs / sequences per step, at least
`--min-steps`), and all measured on the same held-out set: the first `--dev-size` dev records (teacher-forced tau
from every position of their greedy responses) and, with `--worker-prompts N`, the real DFlashWorker's tau on N of
their prompts. A least-squares fit tau = a + b ln(size) extrapolates to 10x the largest size. JSON + PNG; runs
resume per size (a size whose drafter is in OUT is not trained again).

    nohup python scripts/scaling_curve.py --sizes 2000,5000,10000,20000 --epochs 4 --out runs/scaling \
        > runs/scaling.log 2>&1 &
Any TrainConfig field is a flag as in train_dflash.py (--seqs-per-step, --anchors-per-seq, --lr, --device ...).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import numpy as np

from sglang_dflash.training.data import is_dev_record
from sglang_dflash.training.datagen import load_shards
from sglang_dflash.training.trainer import DFlashTrainer, TrainConfig, add_config_flags, config_overrides

FIXED = ("out_dir", "total_steps", "dev_size", "eval_every", "ckpt_every", "init_from", "eval_worker_prompts")


def nested_subset(records: list[dict], size: int, seed: int) -> list[dict]:
    """The first `size` training records of one fixed shuffle (so every subset contains the smaller ones)."""
    train = sorted((r for r in records if not is_dev_record(r["id"])), key=lambda r: r["id"])
    random.Random(f"{seed}-scaling").shuffle(train)
    return train[:size]


def train_size(records: list[dict], dev: list[dict], size: int, args, overrides: dict) -> dict:
    """Trains one drafter on `size` records (resuming an unfinished run) and returns its final evaluation."""
    subset = nested_subset(records, size, overrides.get("seed", 0))
    steps = max(args.min_steps, math.ceil(len(subset) * args.epochs / overrides.get("seqs_per_step", 4)))
    out = args.out / f"size_{size}"
    result_path = out / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    cfg = TrainConfig(out_dir=str(out), total_steps=steps, dev_size=len(dev), eval_every=steps, ckpt_every=100,
                      eval_worker_prompts=args.worker_prompts, **overrides)
    latest = out / "latest"
    trainer = DFlashTrainer(cfg, dev + subset, resume_dir=latest if (latest / "train_state.pt").is_file() else None)
    trainer.run(log_path=out / "history.jsonl")
    last = trainer.history[-1]
    result = {"size": len(subset), "steps": steps, "tokens_seen": trainer.tokens_seen,
              "dev_tau_teacher_forced": last["dev_tau_teacher_forced"], "dev_tau": last.get("dev_tau"),
              "wall_s": last["wall_s"]}
    result_path.write_text(json.dumps(result, indent=2))
    return result


def one_pass(records: list[dict], dev: list[dict], sizes: list[int], args, overrides: dict) -> list[dict]:
    """ONE run over the largest subset at a constant learning rate (after the warm-up), evaluated each time it
    has trained on `size` responses: every point is one epoch over its (nested) subset, compute growing with
    data. Far cheaper than a run per size; resumes from its last checkpoint (results kept per size)."""
    seqs = overrides.get("seqs_per_step", 4)
    subset = nested_subset(records, max(sizes), overrides.get("seed", 0))
    out = args.out / "one_pass"
    results_path = out / "results.json"
    done = json.loads(results_path.read_text()) if results_path.is_file() else {}
    cfg = TrainConfig(out_dir=str(out), total_steps=math.ceil(len(subset) / seqs), dev_size=len(dev),
                      eval_every=10**9, ckpt_every=100, eval_worker_prompts=args.worker_prompts,
                      **{**overrides, "lr_schedule": "constant"})
    latest = out / "latest"
    trainer = DFlashTrainer(cfg, dev + subset, resume_dir=latest if (latest / "train_state.pt").is_file() else None)
    for size in sizes:
        steps = math.ceil(size / seqs)
        if str(size) in done or trainer.step > steps:
            continue
        trainer.run(max_steps=steps - trainer.step, log_path=out / "history.jsonl")
        last = trainer.history[-1]
        done[str(size)] = {"size": size, "steps": steps, "tokens_seen": trainer.tokens_seen,
                           "dev_tau_teacher_forced": last["dev_tau_teacher_forced"], "dev_tau": last.get("dev_tau"),
                           "wall_s": last["wall_s"]}
        trainer.save(f"size_{size}")
        results_path.write_text(json.dumps(done, indent=2))
    return [done[str(s)] for s in sizes if str(s) in done]


def reference_tau(reference: Path, dev: list[dict], args, overrides: dict) -> dict:
    """A finished drafter (e.g. the shipped one) measured on the same held-out records as the curve."""
    cfg = TrainConfig(out_dir=str(args.out / "reference"), init_from=str(reference), total_steps=0,
                      dev_size=len(dev), eval_worker_prompts=args.worker_prompts, **overrides)
    stats = {"step": 0, "drafter": str(reference)}
    DFlashTrainer(cfg, dev).evaluate(stats, 0.0, None)
    return {"drafter": str(reference), "dev_tau_teacher_forced": stats["dev_tau_teacher_forced"],
            "dev_tau": stats.get("dev_tau")}


def fit_log(sizes: list[int], taus: list[float]) -> tuple[float, float]:
    """(a, b) of tau = a + b ln(size), least squares."""
    b, a = np.polyfit(np.log(sizes), taus, 1)
    return float(a), float(b)


def plot(results: list[dict], a: float, b: float, path: Path, reference: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] for r in results]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(sizes, [r["dev_tau_teacher_forced"] for r in results], "o", label="teacher-forced, held-out")
    if all(r["dev_tau"] is not None for r in results):
        ax.plot(sizes, [r["dev_tau"] for r in results], "s", label="DFlashWorker, held-out prompts")
    xs = np.geomspace(min(sizes), 10 * max(sizes), 50)
    ax.plot(xs, a + b * np.log(xs), "--", label=f"fit {a:.2f} + {b:.3f} ln(n)")
    if reference:
        name = Path(reference["drafter"]).name
        ax.axhline(reference["dev_tau_teacher_forced"], color="gray", lw=1, label=f"{name}, teacher-forced")
        if reference["dev_tau"] is not None:
            ax.axhline(reference["dev_tau"], color="gray", lw=1, ls=":", label=f"{name}, DFlashWorker")
    ax.set_xscale("log")
    ax.set_xlabel("training responses")
    ax.set_ylabel("tau (B = 16)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, nargs="+", default=[Path("data/responses")])
    ap.add_argument("--out", type=Path, default=Path("runs/scaling"))
    ap.add_argument("--sizes", default="2000,5000,10000,20000")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--one-pass", action="store_true",
                    help="one run, evaluated as it passes each size (one epoch per point; see one_pass())")
    ap.add_argument("--min-steps", type=int, default=50)
    ap.add_argument("--dev-size", type=int, default=40)
    ap.add_argument("--worker-prompts", type=int, default=0)
    ap.add_argument("--reference", type=Path, default=None, help="a drafter measured on the same held-out set")
    add_config_flags(ap, skip=FIXED)
    args = ap.parse_args()
    overrides = {k: v for k, v in config_overrides(args).items() if k not in FIXED}  # --dev-size is ours
    records = [r for d in args.data for r in load_shards(d)]
    greedy_dev = [r for r in records if is_dev_record(r["id"]) and r["sampling"].get("temperature", 1.0) == 0]
    dev = greedy_dev[: args.dev_size]
    available = sum(not is_dev_record(r["id"]) for r in records)
    sizes = [s for s in map(int, args.sizes.split(",")) if s <= available]
    if len(sizes) < 2:
        raise SystemExit(f"a curve needs two sizes of at most the {available} training records, got {args.sizes}")
    print(f"{len(records)} records, {available} for training, {len(dev)} held out; sizes {sizes}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_pass:
        results = one_pass(records, dev, sizes, args, overrides)
    else:
        results = [train_size(records, dev, size, args, overrides) for size in sizes]
    if len(results) < 2:
        raise SystemExit(f"{len(results)} size(s) measured so far; rerun the same command to go on")
    a, b = fit_log([r["size"] for r in results], [r["dev_tau_teacher_forced"] for r in results])
    reference = reference_tau(args.reference, dev, args, overrides) if args.reference else None
    summary = {"results": results, "fit": {"a": a, "b": b, "form": "tau = a + b ln(size)",
                                           "at_10x": a + b * math.log(10 * results[-1]["size"])},
               "epochs": 1 if args.one_pass else args.epochs, "one_pass": args.one_pass, "overrides": overrides,
               "dev_size": len(dev), "reference": reference}
    (args.out / "scaling.json").write_text(json.dumps(summary, indent=2))
    plot(results, a, b, args.out / "scaling.png", reference)
    for r in results:
        print(f"{r['size']:>7} responses  {r['steps']:>6} steps  teacher-forced tau {r['dev_tau_teacher_forced']:.3f}"
              + (f"  worker tau {r['dev_tau']:.2f}" if r["dev_tau"] is not None else ""))
    print(f"fit: tau = {a:.3f} + {b:.4f} ln(n); at 10x the largest: {summary['fit']['at_10x']:.2f}")
    if reference:
        print(f"reference {reference['drafter']}: teacher-forced tau {reference['dev_tau_teacher_forced']:.3f}")


if __name__ == "__main__":
    main()
