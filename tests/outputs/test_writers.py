"""Shard writers: rotation, atomic commits, round trips and the errors a user can meet."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.errors import CbgenError
from cbgen.records import BASE_FIELDS, RESERVED_NAMES
from cbgen.rows import (
    JsonlShardWriter,
    ParquetShardWriter,
    open_writer,
    read_shards,
)
from cbgen.rows.columns import OutputColumns
from cbgen.rows.schema import arrow_schema

FORMATS = ["jsonl", "parquet"]


def make_row(i: int, *, logprobs: bool = False, **kept: object) -> dict:
    failed = i % 7 == 3
    row = {
        "id": f"req-{i}",
        "sample_index": i % 2,
        "text": None if failed else f"réponse n°{i} — 你好 🙂",
        "token_ids": [] if failed else [i, i + 1, 2**20],
        "num_prompt_tokens": 5 + i,
        "num_generated_tokens": 0 if failed else 3,
        "finish_reason": "error" if failed else ("length" if i % 2 else "stop"),
        "error": "prompt too long (9000 tokens > 8192)" if failed else None,
    }
    if logprobs:
        row["logprobs"] = [] if failed else [-0.5, -0.25, -1.0]  # exact in float32, so round trips compare equal
    row.update(kept)
    return row


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("fmt", FORMATS)
def test_rotation_names_and_counts(tmp_path: Path, fmt: str) -> None:
    rows = [make_row(i) for i in range(25)]
    with open_writer(fmt, tmp_path / "out", rows_per_shard=10) as writer:
        for row in rows:
            writer.write(row)
        assert writer.rows_written == 20  # the third shard is still open
    names = [f"part-{n:05d}.{fmt}" for n in range(3)]
    assert [p.name for p in writer.shards] == names
    assert files_in(tmp_path / "out") == names  # no temporary file left
    assert writer.rows_written == 25
    counts = [len(list(read_shards_of(p))) for p in writer.shards]
    assert counts == [10, 10, 5]
    assert list(read_shards(tmp_path / "out")) == rows


def read_shards_of(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return path.read_text(encoding="utf-8").splitlines()
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_with_logprobs_and_kept_columns(tmp_path: Path, fmt: str) -> None:
    kept_names = ["topic", "score", "n", "tags", "meta", "flag"]
    rows = [
        make_row(
            i,
            logprobs=True,
            topic=f"sujet «{i}»",
            score=i / 4,
            n=i * 1000,
            tags=["a", "ü"][: i % 3],
            meta={"src": "wiki", "len": i},
            flag=i % 2 == 0,
        )
        for i in range(12)
    ]
    with open_writer(fmt, tmp_path, rows_per_shard=5,
                     columns=OutputColumns(logprobs=True, kept=tuple(kept_names))) as writer:
        for row in rows:
            writer.write(row)
    back = list(read_shards(tmp_path))
    assert back == rows
    assert list(back[0]) == [*BASE_FIELDS, "logprobs", *kept_names]  # key order
    if fmt == "jsonl":
        assert "你好" in writer.shards[0].read_text(encoding="utf-8")  # not \u-escaped


def test_parquet_schema_types(tmp_path: Path) -> None:
    kept_schema = pa.schema([("lang", pa.dictionary(pa.int8(), pa.string())), ("other", pa.int8())])
    with ParquetShardWriter(tmp_path, columns=OutputColumns(logprobs=True, kept=("lang",)),
                            kept_schema=kept_schema) as writer:
        writer.write(make_row(0, logprobs=True, lang="fr"))
    schema = pq.read_schema(writer.shards[0])
    assert schema.names == [*BASE_FIELDS, "logprobs", "lang"]
    assert schema.field("id").type == pa.string()
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("token_ids").type == pa.list_(pa.int32())
    assert schema.field("num_prompt_tokens").type == pa.int32()
    assert schema.field("num_generated_tokens").type == pa.int32()
    assert schema.field("logprobs").type == pa.list_(pa.float32())
    assert schema.field("lang").type == pa.dictionary(pa.int8(), pa.string())


def test_arrow_schema() -> None:
    assert "logprobs" not in arrow_schema(OutputColumns(), None).names
    assert arrow_schema(OutputColumns(logprobs=True, kept=("x",)), None) is None  # unknown type: the writer infers it
    schema = arrow_schema(OutputColumns(kept=("x",)), pa.schema([("x", pa.float64())]))
    assert schema.names == [*BASE_FIELDS, "x"] and schema.field("x").type == pa.float64()
    assert RESERVED_NAMES == {*BASE_FIELDS, "logprobs", "top_logprobs", "reasoning", "tool_calls", "parsed"}


def test_parquet_row_groups_are_bounded(tmp_path: Path) -> None:
    with ParquetShardWriter(tmp_path, rows_per_shard=2500) as writer:
        for i in range(2500):
            writer.write(make_row(i))
    meta = pq.ParquetFile(writer.shards[0]).metadata
    assert meta.num_rows == 2500
    assert max(meta.row_group(g).num_rows for g in range(meta.num_row_groups)) <= 1000


def test_parquet_kept_column_null_in_first_shard_then_strings(tmp_path: Path) -> None:
    rows = [make_row(i, note=None, n=None) for i in range(3)]
    rows += [make_row(i, note=f"note {i}", n=i) for i in range(3, 7)]
    with ParquetShardWriter(tmp_path, rows_per_shard=3, columns=OutputColumns(kept=("note", "n"))) as writer:
        for row in rows:
            writer.write(row)
    assert len(writer.shards) == 3
    for shard in writer.shards:
        assert pq.read_schema(shard).field("note").type == pa.string()
    back = list(read_shards(tmp_path))
    assert [r["note"] for r in back] == [None] * 3 + [f"note {i}" for i in range(3, 7)]
    assert [r["n"] for r in back] == [None] * 3 + ["3", "4", "5", "6"]  # typed string by then: kept as text


def test_parquet_kept_column_type_change_is_a_cbgen_error(tmp_path: Path) -> None:
    writer = ParquetShardWriter(tmp_path, rows_per_shard=2, columns=OutputColumns(kept=("n",)))
    writer.write(make_row(0, n=1))
    writer.write(make_row(1, n=2))
    writer.write(make_row(2, n="three"))
    with pytest.raises(CbgenError, match="kept column 'n'"):
        writer.close()
    assert files_in(tmp_path) == ["part-00000.parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_exception_inside_with_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with open_writer(fmt, tmp_path, rows_per_shard=10) as writer:
            for i in range(5):
                writer.write(make_row(i))
            raise RuntimeError("boom")
    assert files_in(tmp_path) == []
    assert writer.shards == [] and writer.rows_written == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_exception_keeps_committed_shards(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(KeyboardInterrupt):
        with open_writer(fmt, tmp_path, rows_per_shard=10) as writer:
            for i in range(15):
                writer.write(make_row(i))
            raise KeyboardInterrupt
    assert files_in(tmp_path) == [f"part-00000.{fmt}"]
    assert len(list(read_shards(tmp_path))) == 10


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_without_rows_commits_nothing_and_is_idempotent(tmp_path: Path, fmt: str) -> None:
    writer = open_writer(fmt, tmp_path)
    writer.close()
    writer.close()
    assert writer.shards == [] and files_in(tmp_path) == []
    with pytest.raises(ValueError):
        writer.write(make_row(0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_shard_then_close_adds_no_empty_shard(tmp_path: Path, fmt: str) -> None:
    with open_writer(fmt, tmp_path, rows_per_shard=5) as writer:
        for i in range(10):
            writer.write(make_row(i))
    assert files_in(tmp_path) == [f"part-00000.{fmt}", f"part-00001.{fmt}"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_shard_numbering_and_read_order(tmp_path: Path, fmt: str) -> None:
    earlier = [make_row(i) for i in range(4)]
    with open_writer(fmt, tmp_path, rows_per_shard=4) as writer:
        for row in earlier:
            writer.write(row)
    later = [make_row(i) for i in range(4, 13)]
    with open_writer(fmt, tmp_path, rows_per_shard=4, first_shard=1) as writer:
        for row in later:
            writer.write(row)
    assert [p.name for p in writer.shards] == [f"part-{n:05d}.{fmt}" for n in (1, 2, 3)]
    (tmp_path / f".part-00004.{fmt}.tmp").write_bytes(b"half a shard")  # a crashed run's leftover is skipped
    assert list(read_shards(tmp_path)) == earlier + later


def test_read_order_is_numeric(tmp_path: Path) -> None:
    with JsonlShardWriter(tmp_path, rows_per_shard=1, first_shard=99999) as writer:
        writer.write(make_row(0))
    with JsonlShardWriter(tmp_path, rows_per_shard=1, first_shard=100000) as writer:
        writer.write(make_row(1))
    assert [r["id"] for r in read_shards(tmp_path)] == ["req-0", "req-1"]


def test_directory_created_with_parents(tmp_path: Path) -> None:
    with JsonlShardWriter(tmp_path / "a" / "b") as writer:
        writer.write(make_row(0))
    assert (tmp_path / "a" / "b" / "part-00000.jsonl").is_file()


@pytest.mark.parametrize("fmt", FORMATS)
def test_unwritable_directory_is_a_cbgen_error(tmp_path: Path, fmt: str) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(CbgenError, match=r"directory '.*file\.txt/out' is not writable: .*choose another with -o"):
        open_writer(fmt, blocker / "out")


def test_read_only_directory_is_a_cbgen_error(tmp_path: Path, monkeypatch) -> None:
    # chmod does not stop root, who runs CI: simulate what the kernel says to other users instead
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(CbgenError, match="is not writable"):
        JsonlShardWriter(tmp_path)


def test_unknown_format_and_reserved_kept_name(tmp_path: Path) -> None:
    with pytest.raises(CbgenError, match="unknown output format 'csv'"):
        open_writer("csv", tmp_path)
    with pytest.raises(CbgenError, match="kept column 'text'"):
        open_writer("jsonl", tmp_path, columns=OutputColumns(kept=("topic", "text")))


def _disk_full(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_full_on_commit(tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = open_writer(fmt, tmp_path, rows_per_shard=3)
    for i in range(3):
        writer.write(make_row(i))
    writer.write(make_row(3))
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(CbgenError, match=f"disk full while writing '.*part-00001.{fmt}'"):
        writer.close()
    monkeypatch.undo()
    assert files_in(tmp_path) == [f"part-00000.{fmt}"]
    assert writer.shards == [tmp_path / f"part-00000.{fmt}"]
    writer.close()  # already aborted: nothing more happens
    with pytest.raises(ValueError):
        writer.write(make_row(4))


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_full_inside_with(tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(CbgenError, match="disk full"):
        with open_writer(fmt, tmp_path, rows_per_shard=2) as writer:
            for i in range(5):
                writer.write(make_row(i))
    assert files_in(tmp_path) == []


def test_disk_full_while_writing_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = JsonlShardWriter(tmp_path)
    writer.write(make_row(0))

    class FullFile:
        def __init__(self, real):
            self.real = real

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str):
            return getattr(self.real, name)

    writer._file = FullFile(writer._file)
    with pytest.raises(CbgenError, match="disk full"):
        writer.write(make_row(1))
    assert files_in(tmp_path) == []
