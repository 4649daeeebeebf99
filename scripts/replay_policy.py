"""Replays the adaptive speculation policy at batch 1 on the target's greedy outputs, without timing anything.

For every prompt, the target's greedy response is generated once; the drafter's teacher-forced accepted run is
computed at every response position (the block [x_a, MASK, ...] over the target's features of x_<a, as
`scripts/eval_drafter.py` does). Then the real `SpecPolicy` (its lookup index included) plans each step of each
response in turn, the outcome of its plan is read off those runs (a lookup proposal is compared with the response),
and the calibrated cost model of this device prices the step. The ratio to AR is the modelled decode time of AR (a
plain step per token) over the policy's. Deterministic, so policy changes compare without a benchmark's noise; the
benchmark (`bench_speculative.py`) still decides (a block narrower than the drafter's drafts from fewer MASK tokens,
which the replay ignores). Modes as in the benchmark: fixed4, adaptive (DFlash alone), default (adaptive + lookup);
`never` is `adaptive` with a drafter whose drafts are never accepted.

  python scripts/replay_policy.py --dataset humaneval:40,mtbench:40 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from bench_speculative import load_prompts

from sglang_dflash import Engine
from sglang_dflash.speculative.cost_model import CostModel
from sglang_dflash.speculative.policy import DFLASH, LOOKUP, NONE, SpecOptions, SpecPolicy, step_shape
from sglang_dflash.training.evaluate import drafter_runs
from sglang_dflash.training.features import target_features

MODES = ("fixed4", "adaptive", "default", "never")


def build(datasets: list[tuple[str, int]], max_new_tokens: int, draft: str | None
          ) -> tuple[list[dict], CostModel, int]:
    """Per response: its dataset, prompt and response ids and the drafter's accepted run at every position; the
    cost model as calibrated (before any step refits it); the drafter's block size."""
    engine = Engine(speculative_algorithm="DFLASH", speculative_draft_model_path=draft, max_running_requests=16)
    try:
        worker = engine.scheduler.worker
        cost = copy.deepcopy(worker.step.policy.cost)
        drafter, runner = worker.step.draft, worker.target.model_runner
        layers = tuple(drafter.config.target_layer_ids)
        seqs = []
        for dataset, count in datasets:
            prompts = [engine.tokenizer_manager.chat_ids([{"role": "user", "content": p}])
                       for p in load_prompts(dataset, count)]
            outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                                       "max_new_tokens": max_new_tokens})
            for prompt, out in zip(prompts, outs):
                response = out["output_ids"]
                if len(response) < 2:
                    continue
                ids = prompt + response
                with torch.inference_mode():
                    runs = drafter_runs(drafter, target_features(runner, [ids], layers)[0], ids, len(prompt))
                seqs.append({"dataset": dataset, "prompt": prompt, "response": response, "runs": runs.tolist()})
    finally:
        engine.shutdown()
    return seqs, cost, drafter.config.block_size


def replay(seqs: list[dict], cost: CostModel, mode: str, block_size: int) -> dict:
    """One policy over the responses in turn (its shared priors learn across them): modelled ratio to AR, tau and
    the share of steps per source."""
    options = SpecOptions(4 if mode == "fixed4" else block_size, adaptive=mode != "fixed4", lookup=mode == "default")
    policy = SpecPolicy(options, cost)
    seconds = ar_seconds = 0.0
    tokens = 0
    steps = dict.fromkeys((DFLASH, LOOKUP, NONE), 0)
    for seq in seqs:
        prompt, response = seq["prompt"], seq["response"]
        runs = [0] * len(seq["runs"]) if mode == "never" else seq["runs"]
        state = policy.new_state()
        done = 1  # the prefill's token
        while done < len(response):
            plan = policy.plan([state], [(prompt, response[:done])], [min(options.block_size, len(response) - done)])[0]
            if plan.source == DFLASH:
                accepted = runs[done - 1]
            elif plan.source == LOOKUP:
                accepted = next((i for i, (t, g) in enumerate(zip(plan.lookup_tokens, response[done:])) if t != g),
                                len(plan.lookup_tokens))
            else:
                accepted = 0
            accepted = min(accepted, plan.block_len - 1, len(response) - done - 1)
            policy.observe([state], [plan], [accepted])
            seconds += cost.step_time(*step_shape([plan]))
            steps[plan.source] += 1
            done += accepted + 1
        tokens += len(response) - 1
        ar_seconds += (len(response) - 1) * cost.step_time(1, 0, 1)
    total = sum(steps.values())
    return {"ratio": ar_seconds / seconds, "tau": tokens / total, "steps": {k: v / total for k, v in steps.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="humaneval:40,mtbench:40", help="comma-separated, each name[:N]")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft", default=None, help="drafter directory (default: the shipped one)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    ap.add_argument("--out", type=Path, default=Path("replay_policy.json"))
    args = ap.parse_args()
    datasets = [(name, int(n) if n else 40) for name, _, n in (d.partition(":") for d in args.dataset.split(","))]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}")
    seqs, cost, block = build(datasets, args.max_new_tokens, args.draft)
    results = {}
    print("| dataset | mode | modelled / AR | tau | steps dflash / lookup / none |\n|---|---|---|---|---|")
    for dataset, _ in datasets:
        part = [s for s in seqs if s["dataset"] == dataset]
        for mode in modes:
            r = results.setdefault(dataset, {})[mode] = replay(part, cost, mode, block)
            shares = " / ".join(f"{r['steps'][k]:.2f}" for k in (DFLASH, LOOKUP, NONE))
            print(f"| {dataset} | {mode} | {r['ratio']:.3f}x | {r['tau']:.2f} | {shares} |")
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
