"""Defaults chosen by the kind of CPU: its instruction set decides the dtype and the batching that run fastest.

The kind is read from the CPU flags (/proc/cpuinfo on Linux), without torch:

  amx-bf16     AMX tiles with bf16 (`amx_bf16`: Intel Sapphire Rapids and later): bf16 matmuls are fast
  avx512-bf16  AVX-512 BF16 without AMX (`avx512_bf16`: AMD Zen 4 and later, some Intel): bf16 is fast too, by
               another kernel, so it has a row of its own
  avx512       AVX-512 without bf16 units: bf16 is emulated and slow, float32 it is
  avx2         AVX2 only (most other x86 servers): bf16 runs at ~1 GFLOP/s, float32 at ~100
  other        anything else (ARM, unknown): float32, the avx2 row's batching

Each row says which machine it was measured on (benchmarks/cpu_tuning.py, the fixed 64 x (128 + 64) workload of
SmolLM2-135M); rows nobody could measure yet borrow a measured row's batching and say so. `run.json` records the row
a CPU run used, under "cpu_defaults". Flags and the YAML file override every value.

`CBGEN_CPU_KIND` names a row to use instead of the one the flags give. It is for measuring and testing another kind's
choices on one machine, together with the variables that hold torch, oneDNN and MKL to that kind's instructions
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`; see docs/development.md): a machine can act
as a smaller kind, never a larger one.
"""

from __future__ import annotations

import os
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from cbgen.errors import CbgenError
from cbgen.process.runtime import RUNTIME


@dataclass(frozen=True)
class CpuRow:
    kind: str
    dtype: str  # what --dtype auto picks on this kind
    # batching defaults with cbgen's per-sequence attention, and with transformers' stock attention (which scores every
    # request against every other's keys, so there smaller batches are faster)
    per_sequence: dict[str, int] = field(default_factory=dict)
    stock: dict[str, int] = field(default_factory=dict)
    measured_on: str = ""

    def batching(self, per_sequence: bool) -> dict[str, int]:
        return dict(self.per_sequence if per_sequence else self.stock)

    def describe(self) -> dict[str, Any]:
        """What run.json records."""
        return asdict(self)


_STOCK = {"max_requests_per_batch": 16, "max_batch_tokens": 1024}
# the best limits for the per-sequence attention on AMX and AVX2 alike (docs/performance.md, the constants)
_PER_SEQUENCE = {"max_requests_per_batch": 64, "max_batch_tokens": 1024}
CPU_ROWS: dict[str, CpuRow] = {
    "amx-bf16": CpuRow("amx-bf16", "bfloat16", _PER_SEQUENCE, _STOCK,
                       "2-core Intel Xeon with AVX-512 and AMX, bf16: 540 tok/s at 64 requests per batch against 356 "
                       "at 16; stock attention 341 at 16 against 195 at 64"),
    "avx512-bf16": CpuRow("avx512-bf16", "bfloat16", _PER_SEQUENCE, _STOCK,
                          "not measured with cpu_tuning.py (a 2-core AMD EPYC Zen 5 measured a 959 GFLOP/s bf16 "
                          "matmul, against 75-140 in float32): the amx-bf16 row's values"),
    "avx512": CpuRow("avx512", "float32", _PER_SEQUENCE, _STOCK,
                     "not measured (no such machine reached): the avx2 row's"),
    "avx2": CpuRow("avx2", "float32", _PER_SEQUENCE, _STOCK,
                   "2-core AMD EPYC (AVX2 only), float32: 181 tok/s at 64 requests per batch (512, 1024 or 2048 batch "
                   "tokens alike) against 143-161 at 32"),
    "other": CpuRow("other", "float32", _PER_SEQUENCE, _STOCK, "not measured: the avx2 row's"),
}


# The variables that hold torch (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL (MKL_ENABLE_INSTRUCTIONS) and
# cbgen's own choices (CBGEN_CPU_KIND) to a smaller kind's instructions: set before torch loads, they make a larger
# machine run what that kind would run (its dtype, its kernels), for tests and for figures said to be held so.
HOLDS: dict[str, dict[str, str]] = {
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512", "CBGEN_CPU_KIND": "avx512-bf16"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "CBGEN_CPU_KIND": "avx512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "CBGEN_CPU_KIND": "avx2"},
}


KIND_ORDER = ("other", "avx2", "avx512", "avx512-bf16", "amx-bf16")  # each kind's instructions include those before


def unholdable_reason(kind: str) -> str | None:
    """Why this CPU cannot be held to `kind` (a HOLDS key), or None: a hold only takes instructions away, so a kind
    above the machine's own would run instructions it does not have (torch and oneDNN stop on them)."""
    own = kind_from_flags(cpu_flags())
    if KIND_ORDER.index(kind) <= KIND_ORDER.index(own):
        return None
    return f"this CPU ({cpu_model()}) is {own}, without {kind}'s instructions: only kinds at or below {own} run here"


def kind_from_flags(flags: AbstractSet[str]) -> str:
    if "amx_bf16" in flags:
        return "amx-bf16"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


@RUNTIME.memo("cpu info", "the first processor's fields in /proc/cpuinfo")
@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in Linux /proc/cpuinfo; empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), or the platform's processor string."""
    import platform

    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_row() -> CpuRow:
    """This machine's row of the CPU-kind table (or the row `CBGEN_CPU_KIND` names)."""
    named = os.environ.get("CBGEN_CPU_KIND")
    if named:
        if named not in CPU_ROWS:
            raise CbgenError(f"CBGEN_CPU_KIND={named}: not a CPU kind; use one of {', '.join(CPU_ROWS)}")
        return CPU_ROWS[named]
    return CPU_ROWS[kind_from_flags(cpu_flags())]
