"""Real SGLang servers for the plugin tests: `python -m sglang.launch_server` from the SGLang CPU venv
(scripts/install_sglang_cpu.sh), each in its own process group, killed at exit.

Run as `.venv-sglang/bin/python tests/sglang_helpers.py MODEL_DIR DRAFTER_DIR` it prints, as JSON, how the
installed plugin registered itself and how SGLang resolves `--speculative-algorithm DFLASH` on CPU.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from server_helpers import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
STARTUP_TIMEOUT_S = 600
CPU_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--max-total-tokens", "8192",
    "--dtype", "float32", "--sleep-on-idle",  # an idle scheduler otherwise spins a core
    "--mem-fraction-static", "0.95",  # sized from free host memory, which other processes share; KV is capped above
]


def sglang_env() -> dict[str, str]:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class SGLangServer:
    """`python -m sglang.launch_server --model-path MODEL ARGS` on a free port of 127.0.0.1."""

    def __init__(self, model: Path, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="sglang-server-", suffix=".log")[1])
        cmd = [str(VENV_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model), *CPU_ARGS, *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=sglang_env())
        atexit.register(self.stop)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> SGLangServer:
        wait_healthy(self.proc, self.url, timeout, "SGLang", self.log_tail)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(line for line in self.log().splitlines() if "Ignore import error" not in line)[-8000:]

    def generate(self, text: str, max_new_tokens: int, request: dict | None = None, **sampling) -> dict:
        """/generate, greedy unless `sampling` says otherwise; `request` adds top-level fields (logprobs)."""
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling},
                **(request or {})}
        r = httpx.post(f"{self.url}/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def registration_report(model: str, drafter: str) -> dict:
    """Entry point, applied hooks, and the resolution of DFLASH on CPU with and without our implementation."""
    import importlib.metadata

    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    entry_points = {e.name: e.value for e in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    load_plugins()

    def resolve(device: str = "cpu"):
        extra = CPU_ARGS if device == "cpu" else ["--device", device]
        args = prepare_server_args(["--model-path", model, "--speculative-algorithm", "DFLASH",
                                    "--speculative-draft-model-path", drafter, *extra])
        args.resolve_once()
        return resolving_view(args)

    cfg = resolve()
    worker = SpeculativeAlgorithm.from_string(cfg.speculative_algorithm).create_worker(cfg)
    report = {
        "entry_points": entry_points, "patched": sorted(HookRegistry._patched),
        "algorithm": cfg.speculative_algorithm, "num_draft_tokens": cfg.speculative_num_draft_tokens,
        "worker": f"{worker.__module__}.{worker.__qualname__}",
    }
    os.environ["SGLANG_DFLASH_IMPL"] = "sglang_dflash"  # ours on a GPU: resolution only (no GPU needed)
    report["cuda_graph_disabled_on_cuda"] = resolve("cuda").disable_cuda_graph
    os.environ["SGLANG_DFLASH_IMPL"] = "sglang"
    try:
        report["builtin"] = resolve().speculative_algorithm
    except ValueError as e:
        report["builtin"] = f"refused: {e}"
    return report


if __name__ == "__main__":
    print(json.dumps(registration_report(sys.argv[1], sys.argv[2])))
