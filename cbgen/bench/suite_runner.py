"""The suite's run, start to end: the machine checked quiet and measured, each section in turn (cbgen.bench.sections),
every row stamped with the machine, then bench.json, bench.png and the table (cbgen.bench.report)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cbgen.bench.machine import measure
from cbgen.bench.suite import Context, Plan, Row, check_quiet, section, summary


def run(plan: Plan, model: str | None, embed_model: str | None, allow_busy: bool, log: Callable[[str], None],
        only: tuple[str, ...] = ()) -> tuple[list[Row], dict[str, Any]]:
    """Every section (or those in `only`) on this machine: the rows, and what the run was (the machine, the plan,
    the load before it, the goals' summary)."""
    from cbgen.bench.sections import SECTIONS, section_goals

    started = time.perf_counter()
    before = check_quiet(allow_busy, log)
    log("measuring the machine's bf16 and float32 matmul rates")
    machine = measure()
    log(f"{machine.label()}: bf16 {machine.bf16_gflops:,.0f} GFLOP/s, float32 {machine.fp32_gflops:,.0f} GFLOP/s")
    rows: list[Row] = []
    took: dict[str, int] = {}  # seconds per section, model loads and warm-ups included
    with tempfile.TemporaryDirectory(prefix="cbgen-suite-") as folder:
        ctx = Context(plan, machine, model, embed_model, Path(folder), log)
        for name, measured in SECTIONS.items():
            if only and name not in only:
                continue
            with section(name, rows, log, section_goals(name, plan), took):
                rows += measured(ctx)
    from cbgen.model import dtype_name

    default_dtype = dtype_name(ctx.loaded["auto"].dtype) if "auto" in ctx.loaded else ""
    for row in rows:
        row.machine = machine.label()
        row.dtype = default_dtype if row.dtype is None else row.dtype
        if row.goal is None:
            continue
        if not row.goal.applies(machine.runs_as):
            row.why_not = f"n/a on {machine.runs_as}"
        elif plan.size != "small":
            row.why_not = f"n/a at size {plan.size}"  # goals are set for the workloads' standard sizes
        elif machine.held and row.against_unheld:
            row.why_not = f"n/a held to {machine.runs_as} (llama.cpp is not held)"
        row.applies = not row.why_not
    meta = {"suite": {"mode": plan.mode, "size": plan.size, "rounds": plan.rounds,
                      "generation_rounds": plan.generation_rounds, "seconds": round(time.perf_counter() - started),
                      "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": list(only) or None,
                      "section_seconds": took},
            "machine": machine.to_dict(), "dtype": default_dtype, "load_before": before, "goals": summary(rows)}
    return rows, meta
