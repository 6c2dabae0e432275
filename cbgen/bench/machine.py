"""The machine a figure was measured on, as every row of the suite names it: the CPU (model, kind, cores), what the
process is held to, the library versions, and the dense matmul rates that bound what any path can reach.

A figure compares only with figures of the same run on the same machine: the same code on two 2-core machines of one
kind has differed by 2x from one hour to the next, so the rates are measured in the run, not looked up.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cbgen.config.cpu import HOLDS, cpu_flags, cpu_model, cpu_row, kind_from_flags


def matmul_flops(dtype: torch.dtype = torch.bfloat16, seconds: float = 2.0, largest: int | None = None,
                 device: str | torch.device = "cpu") -> float:
    """The measured dense matmul rate (FLOP/s) in `dtype` on `device` (where the model runs: a model on a GPU is
    measured against the GPU's rate), the denominator of model FLOP utilisation. Square sizes grow from 256 while one
    product takes under 0.1 s (up to 2,048 on a CPU, 16,384 on a GPU), so a dtype the CPU has no units for (bf16 on
    AVX2: about 1 GFLOP/s) is measured in seconds, not minutes."""
    device = torch.device(device)
    largest = largest or (2048 if device.type == "cpu" else 16384)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n, rate = 256, 0.0
    while True:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        a @ b
        sync()
        count, start = 0, time.perf_counter()
        while count < 2 or time.perf_counter() - start < seconds / 4:
            a @ b
            count += 1
            sync()
        elapsed = time.perf_counter() - start
        rate = max(rate, 2 * n**3 * count / elapsed)
        if n >= largest or elapsed / count > 0.1:
            return rate
        n *= 2


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _commit() -> str | None:
    """The git commit cbgen runs from, where it runs from a checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def held_to() -> str | None:
    """The smaller CPU kind this process is held to (config.cpu.HOLDS, all its variables set), or None."""
    return next((kind for kind, env in HOLDS.items() if all(os.environ.get(k) == v for k, v in env.items())), None)


@dataclass(frozen=True)
class Machine:
    cpu: str  # the model name
    kind: str  # the CPU's own kind (config.cpu): amx-bf16, avx512-bf16, avx512, avx2, other
    runs_as: str  # the kind whose choices and instructions the process uses: `kind`, or the one it is held to
    held: bool  # held to a smaller kind's instructions (HOLDS): its figures are that path's on this CPU
    cores: int  # cores this process may run on
    threads: int  # torch's intra-op threads
    hypervisor: bool
    torch: str
    transformers: str
    cbgen: str
    commit: str | None
    bf16_gflops: float  # dense matmul rates measured in this run
    fp32_gflops: float

    def label(self) -> str:
        """The machine in a table cell: CPU kind, cores, and what it was held to."""
        name = self.cpu.replace("(R)", "").replace("(TM)", "").replace(" Processor", "").replace(" CPU", "").strip()
        held = f", held to {self.runs_as}" if self.held else ""
        return f"{name} ({self.kind}{held}), {self.cores} cores"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"label": self.label()}


def measure(seconds: float = 2.0) -> Machine:
    """This machine, with its bf16 and float32 matmul rates measured now (`seconds` each)."""
    import transformers

    import cbgen

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    flags = cpu_flags()
    held = held_to()
    return Machine(cpu=cpu_model(), kind=kind_from_flags(flags), runs_as=held or cpu_row().kind, held=held is not None,
                   cores=cores, threads=torch.get_num_threads(), hypervisor="hypervisor" in flags,
                   torch=torch.__version__, transformers=transformers.__version__, cbgen=cbgen.__version__,
                   commit=_commit(), bf16_gflops=round(matmul_flops(torch.bfloat16, seconds) / 1e9, 1),
                   fp32_gflops=round(matmul_flops(torch.float32, seconds) / 1e9, 1))
