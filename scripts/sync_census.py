"""The blocking host-device operations of one decode step, AR and DFLASH (fixed blocks of 16, a random drafter),
greedy and sampled, batch 1 and 8: counted by instrumentation (`sglang_dflash.sync_census`, any device) and, on
CUDA, by torch's own sync debug mode as well. Prints a table and writes JSON (gpu_check.sh runs it).

  python scripts/sync_census.py --device cuda --out runs/sync_census.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from dflash_helpers import census_engine, decode_step_census  # noqa: E402


@contextmanager
def torch_sync_debug(counts: list[int]):
    """CUDA only: appends the synchronising calls torch's sync debug mode reports inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts.append(sum("synchroniz" in str(w.message) for w in caught))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("sync_census.json"))
    args = ap.parse_args()
    rows = []
    for algorithm in ("NONE", "DFLASH"):
        engine = census_engine(algorithm, args.device)
        for sampled in (False, True):
            for batch in (1, 8):
                reported: list[int] = []
                around = torch_sync_debug(reported) if torch.device(args.device).type == "cuda" else None
                census = decode_step_census(engine, batch, sampled, around)
                rows.append({"algorithm": algorithm, "sampled": sampled, "batch": batch, "count": census.count,
                             "torch_reported": reported[0] if reported else None,
                             "sites": [{"kind": k, "site": s, "n": n} for (k, s), n in census.by_site().items()]})
                r = rows[-1]
                print(f"{algorithm:6s} {'sampled' if sampled else 'greedy ':7s} batch {batch}: {r['count']:3d} "
                      f"(torch: {r['torch_reported']})  " + ", ".join(f"{x['site']} {x['kind']} x{x['n']}"
                                                                      for x in r["sites"]))
        engine.shutdown()
    args.out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
