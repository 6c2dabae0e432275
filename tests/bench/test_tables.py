"""The docs' performance tables are the suite's JSON, written by cbgen.bench.tables: the README's and
docs/performance.md's marked blocks equal what the committed runs (docs/bench/suite-*.json) give, and every row of
every run names its machine."""

from __future__ import annotations

import json
from pathlib import Path

from cbgen.bench.tables import BLOCK, load_runs, rewrite, verdict

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "docs" / "bench").glob("suite-*.json"))
PAGES = [ROOT / "README.md", ROOT / "docs" / "performance.md"]


def test_the_docs_tables_are_the_suite_runs():
    assert RUNS, "docs/bench holds the suite's runs"
    runs = load_runs(RUNS)
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert BLOCK.search(text), f"{page.name} has no suite block"
        assert rewrite(text, runs) == text, (
            f"{page.relative_to(ROOT)} is stale: python -m cbgen.bench.tables docs/bench/suite-*.json --write "
            "README.md docs/performance.md")


def test_every_row_of_every_run_names_its_machine():
    for path in RUNS:
        data = json.loads(path.read_text(encoding="utf-8"))
        machine = data["meta"]["machine"]
        for field in ("cpu", "kind", "cores", "torch", "transformers", "bf16_gflops", "fp32_gflops"):
            assert machine[field], (path.name, field)
        assert all(row["machine"] == machine["label"] for row in data["rows"]), path.name


def test_a_block_is_rewritten_from_the_rows():
    row = {"section": "s", "name": "cbgen vs x", "figure": 2.5, "unit": "x", "goal": {"text": "≥ 2"}, "met": True,
           "applies": True, "busy": False, "why_not": "", "paths": {"a": [1.0]}, "note": "", "machine": "M",
           "dtype": ""}
    runs = [("suite-m", {"meta": {}, "rows": [row, row | {"busy": True}, row | {"applies": False,
                                                                               "why_not": "n/a on avx2"}]})]
    text = "before\n<!-- suite:goals -->\nold\n<!-- /suite:goals -->\nafter\n"
    new = rewrite(text, runs)
    assert new.startswith("before\n<!-- suite:goals -->\n| comparison")
    assert new.endswith("<!-- /suite:goals -->\nafter\n")
    assert "| cbgen vs x | 2.50x | ≥ 2 | met | M (suite-m) |" in new and "void (busy)" in new and "n/a on avx2" in new
    assert rewrite(new, runs) == new
    assert verdict(row | {"figure": None}) == "not measured" and verdict(row | {"met": False}) == "MISSED"


def test_the_summary_takes_a_comparisons_workloads_together():
    from cbgen.bench.tables import comparison, summary_table

    assert comparison("invariant / stock linear layers, fixed, bfloat16") == "invariant / stock linear layers"
    assert comparison("dedup of 100,000 vectors (5 % copies, threshold 0.95)") == \
        "dedup of 100,000 vectors (5 % copies, threshold 0.95)"  # commas inside parentheses stay
    base = {"section": "s", "unit": "x", "goal": {"text": "≤ 1.05"}, "met": True, "applies": True, "busy": False,
            "why_not": "", "paths": {}, "note": "", "machine": "M", "dtype": ""}
    rows = [base | {"name": "invariant / stock, fixed, bf16", "figure": 0.92},
            base | {"name": "invariant / stock, mixed, bf16", "figure": 1.01},
            base | {"name": "seeded / greedy, per token", "figure": 1.2, "met": False}]
    meta = {"machine": {"label": "M"}, "suite": {"measured_at": "2026-12-06 04:00:00"}}
    text = summary_table([("suite-m", {"meta": meta, "rows": rows})])
    assert "| invariant / stock | ≤ 1.05 | 0.92-1.01x met (2 of 2) |" in text
    assert "| seeded / greedy | ≤ 1.05 | 1.20x MISSED |" in text and "Machines: m: M, 2026-12-06." in text
    mixed = summary_table([("suite-m", {"meta": meta, "rows": rows[:1] + [rows[1] | {"met": False}]})])
    assert "0.92-1.01x met 1, MISSED 1" in mixed


def test_the_headline_is_a_line_per_run_with_its_machine_and_goals():
    from cbgen.bench.tables import headline

    base = {"section": "s", "unit": "x", "goal": {"text": "≥ 2"}, "met": True, "applies": True, "busy": False,
            "why_not": "", "paths": {}, "note": "", "machine": "M", "dtype": ""}
    rows = [base | {"name": "cbgen vs generate_batch, fixed", "figure": 6.28},
            base | {"name": "invariant / stock, fixed, bf16", "figure": 0.8, "goal": {"text": "≤ 1.05"}},
            base | {"name": "invariant / stock, mixed, bf16", "figure": 0.7, "goal": {"text": "≤ 1.05"}},
            base | {"name": "warm start", "figure": 3.7, "unit": "s", "goal": None}]
    meta = {"machine": {"label": "AMD EPYC (avx512-bf16), 2 cores"}, "dtype": "bfloat16",
            "suite": {"measured_at": "2026-12-06 06:05:00", "mode": "full"},
            "goals": {"met": 3, "missed": 0, "void": 0}}
    (line,) = headline([("suite-zen4", {"meta": meta, "rows": rows})]).splitlines()
    assert line.startswith("- **AMD EPYC (avx512-bf16), 2 cores**, bfloat16, full run of 2026-12-06 "
                           "([suite-zen4](docs/bench/suite-zen4.json)): ")
    assert "cbgen vs generate_batch 6.28x met, goal ≥ 2; " in line
    assert "invariant / stock 0.70-0.80x met (2 of 2), goal ≤ 1.05." in line
    assert "warm start" not in line and line.endswith("Goals: 3 met, 0 missed, 0 void, 0 not measured.")
