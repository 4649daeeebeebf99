#!/usr/bin/env bash
# One-command GPU validation of the DFlash kernels (about 8 minutes at most):
#   1. tests/test_kernels.py + tests/test_device.py with Triton compiled natively (no interpreter),
#   2. tests/test_lossless*.py on SGLANG_DFLASH_TEST_DEVICE=cuda (skipped when absent),
#   3. scripts/bench_kernels.py at serving shapes -> $OUT_DIR/kernels.json.
# Every step runs even if an earlier one fails; the exit status is non-zero if any failed.
# Usage: OUT_DIR=runs/gpu_check scripts/gpu_check.sh   (OUT_DIR defaults to $OUT, then runs/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-${OUT:-runs/gpu_check}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET SGLANG_DFLASH_KERNELS
status=0

step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name"
    if timeout "$limit" "$@"; then
        echo "=== $name: ok ($((SECONDS - start)) s)"
    else
        echo "=== $name: FAILED rc=$? ($((SECONDS - start)) s)"
        status=1
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step kernel-tests 150 python -m pytest -q tests/test_kernels.py tests/test_device.py
shopt -s nullglob
lossless=(tests/test_lossless*.py)
if ((${#lossless[@]})); then
    step lossless-tests 210 env SGLANG_DFLASH_TEST_DEVICE=cuda python -m pytest -q "${lossless[@]}"
else
    echo "=== lossless-tests: none found, skipped"
fi
step bench-kernels 100 python scripts/bench_kernels.py --device cuda --out "$OUT_DIR/kernels.json"
exit $status
