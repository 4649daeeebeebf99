"""Resolves a model path to an HF-style directory (config.json, safetensors, tokenizer files).

A GGUF file is converted once into a cache directory keyed by the file's sha256, so later
starts only memory-map safetensors. The same conversion backs `python -m sglang_dflash.convert`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.default_model import default_model_path


def cache_root() -> Path:
    base = os.environ.get("SGLANG_DFLASH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sglang_dflash"
    )
    return Path(base)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Writes config.json, model.safetensors (float32, dequantised) and tokenizer files to out_dir."""
    import gguf

    from sglang_dflash.models.gguf_loader import load_gguf_tokenizer, read_config, read_weights

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = read_config(reader)
    weights = read_weights(reader, cfg)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf = cfg.to_hf_dict()
        tok = load_gguf_tokenizer(gguf_path)
        tok.save_pretrained(str(tmp))
        hf["pad_token_id"] = tok.pad_token_id
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": hf["eos_token_id"]}, indent=2)
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def resolve_model_dir(model_path: str | os.PathLike | None) -> Path:
    """HF directory for a model path (None = the default model); GGUF files go through the cache."""
    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        key = f"{path.stem}-{file_sha256(path)[:16]}"
        out = cache_root() / "converted" / key
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(path, out)
        return out
    raise FileNotFoundError(f"model path {path} is neither an HF directory nor a .gguf file")


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of an HF directory, names as stored."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def load_model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.load(model_dir)
