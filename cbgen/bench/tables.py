"""The suite's tables in the docs, written from its bench.json files, so that no figure in the README or
docs/performance.md is one the suite cannot reproduce:

    python -m cbgen.bench.tables docs/bench/suite-*.json --write README.md docs/performance.md

Each file to write holds marked blocks, `<!-- suite:NAME -->` ... `<!-- /suite:NAME -->`, which are replaced:
`goals` (every row with a goal, from every run), `summary` (those, a comparison's workloads together, a column per
run), `headline` (the same, a line per run: the README's), `runs` (each run's machine and what it measured), and
`full:STEM` (every row of the run docs/bench/STEM.json). Torch-free: it reads JSON and
writes Markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"(<!-- suite:(?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- /suite:(?P=name) -->)", re.S)


def verdict(row: dict[str, Any]) -> str:
    """A row's standing against its goal, in a word or three (bench.json files written before rows carried their
    standing are read the same way)."""
    if row["goal"] is not None and not row["applies"] and row["figure"] is not None:
        return row.get("why_not") or "n/a"
    if row["figure"] is None:
        return "not measured"
    if row["busy"]:
        return "void (busy)"
    if row["goal"] is None:
        return ""
    return "met" if row["met"] else "MISSED"


def figure_text(row: dict[str, Any]) -> str:
    if row["figure"] is None:
        return "—"
    return f"{row['figure']:.2f}x" if row["unit"] == "x" else f"{row['figure']:.2f} s"


def runs_of(row: dict[str, Any]) -> int:
    """How many times a row's paths were each timed (the fewest of them)."""
    return min((len(v) for v in row["paths"].values()), default=0)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def goals_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| comparison | figure | goal | verdict | machine (run) |", "|---|---:|---|---|---|"]
    for stem, data in runs:
        for row in data["rows"]:
            if row["goal"] is not None:
                lines.append(f"| {_cell(row['name'])} | {figure_text(row)} | {row['goal']['text']} | "
                             f"{verdict(row)} | {_cell(row['machine'])} ({stem}) |")
    return "\n".join(lines) + "\n"


def comparison(name: str) -> str:
    """A row's comparison without its workload: the part of its name before the first comma outside parentheses
    ("invariant / stock linear layers, fixed, bfloat16" -> "invariant / stock linear layers")."""
    depth = 0
    for i, char in enumerate(name):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if name.startswith(", ", i) and depth == 0:
            return name[:i]
    return name


def by_comparison(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A run's rows with a goal, grouped by their comparison (cbgen.bench.tables.comparison), in the run's order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["goal"] is not None:
            grouped.setdefault(comparison(row["name"]), []).append(row)
    return grouped


def _group_cell(rows: list[dict[str, Any]]) -> str:
    """The figures of one comparison's rows in one run (their range), and how many met their goal."""
    figures = sorted(row["figure"] for row in rows if row["figure"] is not None)
    if not figures:
        return "not measured"
    unit = "x" if rows[0]["unit"] == "x" else " s"
    shown = f"{figures[0]:.2f}{unit}" if figures[0] == figures[-1] else f"{figures[0]:.2f}-{figures[-1]:.2f}{unit}"
    verdicts = [verdict(row) for row in rows]
    if len(rows) == 1:
        said = verdicts[0]
    elif all(v == "met" for v in verdicts):
        said = f"met ({len(rows)} of {len(rows)})"
    else:
        counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
        said = ", ".join(f"{v} {n}" for v, n in counts.items())
    return f"{shown} {said}"


def summary_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Every comparison with a goal, its rows of one run taken together (the workloads, dtypes and sizes it was
    measured on), a column per run: the figures' range and how many met the goal."""
    names: dict[str, str] = {}
    cells: dict[tuple[str, str], str] = {}
    for stem, data in runs:
        for name, rows in by_comparison(data["rows"]).items():
            names.setdefault(name, rows[0]["goal"]["text"])
            cells[name, stem] = _group_cell(rows)
    stems = [stem for stem, _ in runs]
    lines = ["| comparison | goal | " + " | ".join(s.removeprefix("suite-") for s in stems) + " |",
             "|---|---|" + "---:|" * len(stems)]
    for name, goal in names.items():
        lines.append(f"| {_cell(name)} | {goal} | " + " | ".join(cells.get((name, s), "—") for s in stems) + " |")
    machines = "; ".join(f"{s.removeprefix('suite-')}: {d['meta']['machine']['label']}, "
                         f"{d['meta']['suite']['measured_at'][:10]}" for s, d in runs)
    return "\n".join(lines) + f"\n\nMachines: {machines}.\n"


def headline(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """A line per run: its machine, each comparison with a goal (its rows taken together) and its goal, and how many
    goals were met: the README's."""
    lines = []
    for stem, data in runs:
        meta = data["meta"]
        items = "; ".join(f"{_cell(name)} {_group_cell(rows)}, goal {rows[0]['goal']['text']}"
                          for name, rows in by_comparison(data["rows"]).items())
        g = meta["goals"]
        lines.append(f"- **{_cell(meta['machine']['label'])}**, {meta.get('dtype') or 'float32'}, "
                     f"{meta['suite']['mode']} run of {meta['suite']['measured_at'][:10]} "
                     f"([{stem}](docs/bench/{stem}.json)): {items}. Goals: {g['met']} met, {g['missed']} missed, "
                     f"{g['void']} void, {_applying_unmeasured(data['rows'])} not measured.")
    return "\n".join(lines) + "\n"


def _applying_unmeasured(rows: list[dict[str, Any]]) -> int:
    """Rows whose goal applies to their run's machine and that have no figure."""
    return sum(row["goal"] is not None and row["applies"] and row["figure"] is None for row in rows)


def runs_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| run | machine | dtype | torch / transformers | matmul bf16 / float32 (GFLOP/s) | mode | took | goals "
             "met / missed / void / not measured |", "|---|---|---|---|---:|---|---:|---|"]
    for stem, data in runs:
        meta, m = data["meta"], data["meta"]["machine"]
        g = meta["goals"]
        lines.append(f"| [{stem}](bench/{stem}.json) | {_cell(m['label'])} | {meta.get('dtype', '')} | "
                     f"{m['torch']} / {m['transformers']} | {m['bf16_gflops']:,.0f} / {m['fp32_gflops']:,.0f} | "
                     f"{meta['suite']['mode']}, {meta['suite']['measured_at'][:10]} | {meta['suite']['seconds']} s | "
                     f"{g['met']} / {g['missed']} / {g['void']} / {_applying_unmeasured(data['rows'])} |")
    return "\n".join(lines) + "\n"


def full_table(stem: str, data: dict[str, Any]) -> str:
    lines = [f"Run `{stem}` on {data['meta']['machine']['label']}, {data['meta']['suite']['measured_at']}:", "",
             "| section | comparison | dtype | figure | goal | verdict | runs | note |",
             "|---|---|---|---:|---|---|---:|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['section']} | {_cell(row['name'])} | {row.get('dtype') or ''} | {figure_text(row)} | "
                     f"{row['goal']['text'] if row['goal'] else ''} | {verdict(row)} | {runs_of(row)} | "
                     f"{_cell(row['note'])} |")
    return "\n".join(lines) + "\n"


def render(name: str, runs: list[tuple[str, dict[str, Any]]]) -> str:
    if name == "goals":
        return goals_table(runs)
    if name == "runs":
        return runs_table(runs)
    if name == "summary":
        return summary_table(runs)
    if name == "headline":
        return headline(runs)
    if name.startswith("full:"):
        stem = name.removeprefix("full:")
        found = dict(runs)
        if stem not in found:
            raise KeyError(f"no suite run named {stem!r} among {', '.join(found)}")
        return full_table(stem, found[stem])
    raise KeyError(f"unknown suite block {name!r}: goals, summary, headline, runs or full:STEM")


def rewrite(text: str, runs: list[tuple[str, dict[str, Any]]]) -> str:
    """`text` with every marked block replaced by its table."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name"), runs) + m.group(4), text)


def load_runs(paths: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """The runs, each machine as it is before the runs held to a smaller kind's instructions."""
    runs = [(path.stem, json.loads(path.read_text(encoding="utf-8"))) for path in paths]
    return sorted(runs, key=lambda run: (bool(run[1]["meta"]["machine"].get("held")), run[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="the suite's bench.json files (docs/bench/suite-*.json)")
    parser.add_argument("--write", nargs="+", type=Path, default=[], help="files whose marked blocks to rewrite")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if not args.write:
        sys.stdout.write(goals_table(runs))
    for path in args.write:
        path.write_text(rewrite(path.read_text(encoding="utf-8"), runs), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
