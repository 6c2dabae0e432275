"""What `cbgen bench` reports: one row per measurement (ratios to cbgen, MFU), bench.json and bench.png."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from cbgen.bench.machine import parameter_count
from cbgen.bench.paths import Measurement
from cbgen.errors import CbgenError
from cbgen.model import dtype_name
from cbgen.model.load import LoadedModel


def summarise(results: list[Measurement], flops_per_token: float, peak_flops: float) -> list[dict[str, Any]]:
    """One row per measurement, with its wall-time ratio to cbgen on the same workload and its MFU."""
    cbgen_time = {m.workload: m.seconds for m in results if m.path == "cbgen"}
    cbgen_tokens = {m.workload: max(m.generated_tokens, 1) for m in results if m.path == "cbgen"}
    rows = []
    for m in results:
        rows.append({
            "workload": m.workload, "path": m.path, "seconds": round(m.seconds, 2), "requests": m.requests,
            "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
            "prompt_tok_s": round(m.prompt_tokens_per_s, 1), "generated_tok_s": round(m.generated_tokens_per_s, 1),
            "total_tok_s": round(m.total_tokens_per_s, 1),
            "time_vs_cbgen": round(m.seconds / cbgen_time[m.workload], 2) if m.workload in cbgen_time else None,
            # time per generated token, against cbgen's: for paths whose outputs differ in length (a schema)
            "token_time_vs_cbgen": (round(m.seconds / m.generated_tokens / (cbgen_time[m.workload] / cbgen_tokens[
                m.workload]), 2) if m.workload in cbgen_time and m.generated_tokens else None),
            **{k: v for k, v in m.extra.items() if k not in ("cb", "tokens")},
            "mfu": round(m.total_tokens_per_s * flops_per_token / peak_flops, 4),
        })
    return rows


def write_outputs(rows: list[dict[str, Any]], meta: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """bench.json (rows + how they were measured) and bench.png (total tokens/s per workload and path)."""
    try:
        import matplotlib
    except ImportError:
        raise CbgenError("cbgen bench draws its chart with matplotlib: pip install 'cbgen[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4))
    width = 0.8 / len(paths)
    for j, path in enumerate(paths):
        values = [next((r["total_tok_s"] for r in rows if r["workload"] == w and r["path"] == path), 0)
                  for w in workloads]
        ax.bar([i + j * width for i in range(len(workloads))], values, width, label=path)
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel("prompt + generated tokens / s")
    ax.set_title(f"cbgen bench: {meta.get('model')} ({meta.get('dtype')}, {meta.get('device')})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    png_path = directory / "bench.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def meta_for(loaded: LoadedModel, size: str, peak_flops: float, batching: dict[str, Any],
             scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """bench.json's description of the run; `scope`: what the cbgen path installs (ScopePlan.describe)."""
    return {"model": loaded.source.name, "dtype": dtype_name(loaded.dtype), "device": loaded.device,
            "attn_implementation": loaded.attn_implementation, "size": size,
            "onednn_linear": bool(scope and scope["linear"].startswith("onednn")),
            "linear": scope["linear"] if scope else None, "engine_scope": scope,
            "parameters": parameter_count(loaded.model), "matmul_flops": round(peak_flops),
            "matmul_dtype": dtype_name(loaded.dtype),
            "batching_overrides": batching, "torch_threads": torch.get_num_threads(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


# the suite (cbgen.bench.suite) --------------------------------------------------------------------------------------


def write_suite(rows: list[Any], meta: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """bench.json (the machine, the run, every row with its samples and load) and bench.png (each ratio against
    its goal)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:  # checked before a file is written
        raise CbgenError("cbgen bench draws its chart with matplotlib: pip install 'cbgen[bench]'")
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    data = [r.to_dict() for r in rows]
    json_path.write_text(json.dumps({"meta": meta, "rows": data}, indent=2) + "\n")
    png_path = directory / "bench.png"
    plot_suite(data, meta, png_path)
    return json_path, png_path


def plot_suite(rows: list[dict[str, Any]], meta: dict[str, Any], png_path: Path) -> None:
    """Each ratio of a suite run (its bench.json's rows and meta) against its goal, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["figure"] is not None and r["unit"] == "x"]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(shown) + 1.6))
    for i, row in enumerate(shown):
        colour = "grey" if row["busy"] else ("tab:green" if row["met"] is not False else "tab:red")
        ax.barh(i, row["figure"], color=colour)
        if row["goal"] is not None and row["applies"]:
            ax.plot([row["goal"]["value"]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(shown)), [r["name"] for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ratio (black bar: the goal; grey: measured under load, void)")
    ax.set_title(f"cbgen bench --suite ({meta['suite']['mode']}): {meta['machine']['label']}", fontsize=9)
    fig.savefig(png_path, dpi=110, bbox_inches="tight")  # the longest names whole
    plt.close(fig)


def print_suite(rows: list[Any], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    m = meta["machine"]
    table = Table(title=f"cbgen bench --suite ({meta['suite']['mode']}) on {m['label']}: torch {m['torch']}, "
                  f"transformers {m['transformers']}, {m['threads']} threads; matmul bf16 {m['bf16_gflops']:,.0f}, "
                  f"float32 {m['fp32_gflops']:,.0f} GFLOP/s", title_justify="left")
    for column in ("section", "comparison", "figure", "goal", "verdict", "runs", "note"):
        table.add_column(column, justify="right" if column in ("figure", "runs") else "left", overflow="fold")
    from cbgen.bench.tables import figure_text, runs_of, verdict

    for row in rows:
        data = row.to_dict()
        table.add_row(row.section, row.name, figure_text(data), row.goal.text() if row.goal else "", verdict(data),
                      str(runs_of(data)), row.note)
    out = Console()
    if not out.is_terminal:
        out.width = 200  # a log file: do not wrap the table at 80 columns
    out.print(table)
    goals = meta["goals"]
    out.print(f"goals: {goals['met']} met, {goals['missed']} missed, {goals['void']} void (measured under load, or "
              f"where the load could not be read), {goals['not_measured']} not measured, of those that apply here; "
              f"{meta['suite']['seconds']} s", markup=False)
