"""The blocking host-device operations per decode step: AR, DFLASH in fixed blocks of 16 and DFLASH with its defaults
(adaptive blocks, context lookup), a random drafter; greedy, sampled and with penalties; batch 1 and 8; counted by
instrumentation (`sglang_dflash.sync_census`, any device) and, on CUDA, by torch's own sync debug mode as well.
Prints a table and writes JSON (gpu_check.sh runs it).

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
from dflash_helpers import CENSUS_ENGINES, CENSUS_SAMPLING, census_engine, decode_step_census  # noqa: E402

STEPS = 4


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
    for name in CENSUS_ENGINES:
        engine = census_engine(name, args.device)
        for sampling in CENSUS_SAMPLING:
            for batch in (1, 8):
                reported: list[int] = []
                around = torch_sync_debug(reported) if torch.device(args.device).type == "cuda" else None
                census = decode_step_census(engine, batch, sampling, around, steps=STEPS)
                rows.append({"engine": name, "sampling": sampling, "batch": batch, "steps": STEPS,
                             "count": census.count, "torch_reported": reported[0] if reported else None,
                             "sites": [{"kind": k, "site": s, "n": n} for (k, s), n in census.by_site().items()]})
                r = rows[-1]
                print(f"{name:15s} {sampling:9s} batch {batch}: {r['count']:3d} in {STEPS} steps "
                      f"(torch: {r['torch_reported']})  " + ", ".join(f"{x['site']} {x['kind']} x{x['n']}"
                                                                      for x in r["sites"]))
        engine.shutdown()
    args.out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
