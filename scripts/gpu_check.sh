#!/usr/bin/env bash
# One-command device validation of the DFlash kernels and engine from a bare checkout (no install, no model
# hub, no default GGUF: the tests build a random stand-in target, tests/dflash_helpers.py); under 8 minutes
# (the step time limits add up to 490 s).
#   environment        versions, the device, where sglang_dflash imports from -> $OUT_DIR/environment.json
#   kernel-tests       tests/test_kernels.py + tests/test_device.py + tests/test_decode_attention.py: Triton
#                      compiled natively (no interpreter) on an accelerator; on cpu the torch path only
#   lossless-tests     tests/test_lossless_*.py with every Engine on the device (SGLANG_DFLASH_TEST_DEVICE)
#   bench-kernels      scripts/bench_kernels.py at serving shapes -> $OUT_DIR/kernels.json
#   decode-timing      scripts/decode_timing.py: AR vs DFLASH tokens/s -> $OUT_DIR/decode_timing.json
#   sync-census        scripts/sync_census.py: blocking host-device operations per decode step (instrumented, and
#                      torch's sync debug mode on CUDA) -> $OUT_DIR/sync_census.json
# Every step runs, time-limited, even if an earlier one fails; the exit status is non-zero if any failed.
# $OUT_DIR/summary.json: each step's status and seconds, the environment and the decode timing.
# Usage: [CHECK_DEVICE=cuda|xpu|cpu] [CHECK_SIZE=full|tiny] [OUT_DIR=dir] scripts/gpu_check.sh
#   CHECK_DEVICE defaults to cuda; OUT_DIR to $OUT, then runs/gpu_check. CHECK_SIZE=tiny: a 5-layer stand-in
#   target, one greedy and one sampling lossless test, small benchmark shapes (CI's dry run: tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
DEVICE=${CHECK_DEVICE:-cuda}
SIZE=${CHECK_SIZE:-full}
OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd -P)
unset TRITON_INTERPRET SGLANG_DFLASH_KERNELS
export SGLANG_DFLASH_TEST_DEVICE=$DEVICE

source "$ROOT/scripts/bare_checkout.sh"

kernel_args=() bench_args=() decode_args=()
lossless_tests=("$ROOT/tests/test_lossless_greedy.py" "$ROOT/tests/test_lossless_sampling.py")
if [[ $DEVICE == cpu ]]; then
    kernel_args=(-k "not triton")
fi
if [[ $SIZE == tiny ]]; then
    export SGLANG_DFLASH_TEST_STANDIN_LAYERS=5  # the fewest that a 2-layer drafter can read from
    lossless_tests=("${lossless_tests[0]}::test_oracle_drafter_matches_ar[0.0]"
                    "${lossless_tests[1]}::test_dflash_sampling_matches_exact[T1]")
    bench_args=(--tokens 16 --batch 1 --vocab 4096 --context 64)
    decode_args=(--prompts 2 --new-tokens 16)
elif [[ $SIZE != full ]]; then
    echo "CHECK_SIZE must be full or tiny, got '$SIZE'" >&2
    exit 2
fi

status=0
steps=()
step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2 start=$SECONDS rc result=ok
    shift 2
    echo "=== $name"
    timeout -k 5 "$limit" "$@"
    rc=$?
    if ((rc == 124 || rc == 137)); then
        result=timeout
    elif ((rc != 0)); then
        result=failed
    fi
    ((rc == 0)) || status=1
    echo "=== $name: $result rc=$rc ($((SECONDS - start)) s)"
    steps+=("{\"name\": \"$name\", \"status\": \"$result\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}")
}

[[ $DEVICE == cuda ]] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }
step environment 20 python - "$OUT_DIR/environment.json" "$DEVICE" <<'EOF'
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

import torch

import sglang_dflash.kernels
import sglang_dflash.scheduler
from sglang_dflash.device import resolve_device
from sglang_dflash.kernels.backend import triton_available, triton_import_error

device = resolve_device(sys.argv[2])
info = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "triton": version("triton") if triton_available() else triton_import_error(),
    "device": str(device),
    "device_name": torch.get_device_module(device.type).get_device_name(device) if device.type != "cpu" else None,
    "kernels_from": str(Path(sglang_dflash.kernels.__file__).resolve().parent),
    "scheduler_from": str(Path(sglang_dflash.scheduler.__file__).resolve().parent),
}
Path(sys.argv[1]).write_text(json.dumps(info, indent=2))
print(info)
EOF
step kernel-tests 120 python -m pytest -q "$ROOT/tests/test_kernels.py" "$ROOT/tests/test_device.py" \
    "$ROOT/tests/test_decode_attention.py" "${kernel_args[@]}"
step lossless-tests 180 python -m pytest -q "${lossless_tests[@]}"
step bench-kernels 50 python "$ROOT/scripts/bench_kernels.py" --device "$DEVICE" --out "$OUT_DIR/kernels.json" \
    "${bench_args[@]}"
step decode-timing 60 python "$ROOT/scripts/decode_timing.py" --device "$DEVICE" --out "$OUT_DIR/decode_timing.json" \
    "${decode_args[@]}"
step sync-census 60 python "$ROOT/scripts/sync_census.py" --device "$DEVICE" --out "$OUT_DIR/sync_census.json"

python - "$OUT_DIR" "$DEVICE" "$SIZE" "${steps[@]}" <<'EOF' || status=1
import json
import sys
from pathlib import Path

out, device, size, *steps = sys.argv[1:]
summary = {"device": device, "size": size, "steps": [json.loads(s) for s in steps]}
summary["ok"] = all(s["status"] == "ok" for s in summary["steps"])
for name in ("environment", "decode_timing", "sync_census"):
    path = Path(out) / f"{name}.json"
    summary[name] = json.loads(path.read_text()) if path.is_file() else None
(Path(out) / "summary.json").write_text(json.dumps(summary, indent=2))
print(f"wrote {out}/summary.json: ok={summary['ok']}")
EOF
exit $status
