"""The committed response format: compressed uint16 shards round-trip exactly, and the writer numbers shards
after existing ones and writes only whole shards until the final flush."""

from __future__ import annotations

from pathlib import Path

from sglang_dflash.training.datagen import ShardWriter, load_shards, read_shard, write_shard

DATA = Path(__file__).resolve().parents[1] / "data" / "responses"


def test_committed_shards_round_trip(tmp_path: Path):
    records = read_shard(sorted(DATA.glob("shard_*.npz"))[0])
    assert len(records) > 100 and all(r["response_ids"] and r["prompt_ids"] for r in records)
    write_shard(tmp_path / "shard_00000.npz", records)
    assert load_shards(tmp_path) == records


def test_writer_continues_numbering_and_flushes_whole_shards(tmp_path: Path):
    records = read_shard(sorted(DATA.glob("shard_*.npz"))[0])[:7]
    write_shard(tmp_path / "shard_00000.npz", records[:2])
    writer = ShardWriter(tmp_path, shard_size=3)
    for r in records[2:]:
        writer.write(r)
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["shard_00000.npz", "shard_00001.npz"]
    writer.flush()
    assert sorted(p.name for p in tmp_path.glob("*.npz"))[-1] == "shard_00002.npz"
    assert load_shards(tmp_path) == records
