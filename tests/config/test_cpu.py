"""The CPU-kind table: the kind read from the CPU flags, its row's defaults used by a CPU run and recorded in run.json,
and flags still winning over it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cbgen.cli import run_cli
from cbgen.config import cpu
from cbgen.errors import CbgenError


@pytest.mark.parametrize(("flags", "kind"), [
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512-bf16"),  # AMD Zen 4 and 5: bf16 units without AMX
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "amx-bf16"),
    ({"avx2", "avx512f", "avx512bw"}, "avx512"),
    ({"avx2", "fma", "sse4_2"}, "avx2"),
    ({"neon", "asimd"}, "other"),
    (set(), "other"),
])
def test_kind_from_flags(flags, kind):
    assert cpu.kind_from_flags(flags) == kind


def test_a_named_kind_stands_in_for_the_flags(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu.cpu_row().kind == "avx512-bf16"
    monkeypatch.setenv("CBGEN_CPU_KIND", "avx2")
    assert cpu.cpu_row().kind == "avx2" and cpu.cpu_row().dtype == "float32"
    monkeypatch.setenv("CBGEN_CPU_KIND", "avx3")
    with pytest.raises(CbgenError, match="CBGEN_CPU_KIND=avx3: not a CPU kind; use one of amx-bf16, "):
        cpu.cpu_row()


def test_rows_pick_bfloat16_only_with_bf16_units():
    assert {kind: row.dtype for kind, row in cpu.CPU_ROWS.items()} == {
        "amx-bf16": "bfloat16", "avx512-bf16": "bfloat16", "avx512": "float32", "avx2": "float32",
        "other": "float32"}
    assert all(row.measured_on and row.per_sequence and row.stock for row in cpu.CPU_ROWS.values())


@pytest.mark.parametrize("flag", [None, "5"])
def test_a_cpu_run_starts_from_its_row_and_records_it(tiny_model_dir, tmp_path, monkeypatch, flag):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    row = dataclasses.replace(cpu.CPU_ROWS["avx2"], per_sequence={"max_requests_per_batch": 3, "max_batch_tokens": 96})
    monkeypatch.setitem(cpu.CPU_ROWS, "avx2", row)
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9, 10]}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    args = ["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "--device",
            "cpu", "--max-new-tokens", "3", "-q"]
    assert run_cli(args + (["--max-requests-per-batch", flag] if flag else [])) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["cpu_defaults"]["kind"] == "avx2"
    assert manifest["cpu_defaults"]["per_sequence"] == {"max_requests_per_batch": 3, "max_batch_tokens": 96}
    assert manifest["continuous_batching"]["max_batch_tokens"] == 96
    assert manifest["continuous_batching"]["max_requests_per_batch"] == (int(flag) if flag else 3)
