"""`python -m sglang_dflash.convert [MODEL] [--out DIR]`: a model as an HF safetensors directory for SGLang.

MODEL is a GGUF file or an HF directory (default: the bundled SmolLM2-135M-Instruct GGUF). GGUF files are
converted once into sglang_dflash's cache (config.json with `architectures`, float32 model.safetensors,
tokenizer files, chat template); `--out` copies the result to DIR. Prints the directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from sglang_dflash.models.model_store import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: Path) -> None:
    """What SGLang needs from a model directory: architectures, weights and a tokenizer."""
    config = json.loads((path / "config.json").read_text())
    if not config.get("architectures"):
        raise ValueError(f"{path}/config.json has no `architectures`")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer file ({', '.join(TOKENIZER_FILES)})")


def convert(model: str | None, out: Path | None = None) -> Path:
    src = resolve_model_dir(model)
    check_model_dir(src)
    if out is None:
        return src
    out = out.expanduser().resolve()
    if out == src.resolve():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_dflash.convert", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="GGUF file or HF directory (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--out", type=Path, help="copy the HF directory here (default: print the cache directory)")
    args = parser.parse_args(argv)
    try:
        path = convert(args.model, args.out)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
