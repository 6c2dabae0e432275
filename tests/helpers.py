"""Small helpers shared by tests."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from cbgen.config.cpu import HOLDS


def write_jsonl(path: Path, rows: list) -> Path:
    """Writes rows (dicts, or raw strings written as they are) as JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@contextlib.contextmanager
def disk_full_at_shard(commit: int):
    """The disk fills up as a run in this process commits its `commit`-th shard (os.replace of a part-* file raises
    ENOSPC): the run stops part-way, its earlier shards committed and the requests in flight lost, as a real fault
    in its writer leaves it (the run exits 2). Restored when the block ends."""
    real_replace = os.replace
    calls = {"n": 0}

    def full_disk(src, dst):
        calls["n"] += "part-" in str(dst)
        if calls["n"] == commit and "part-" in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    os.replace = full_disk
    try:
        yield
    finally:
        os.replace = real_replace


def torchrun_cbgen(*args, processes: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m cbgen run ARGS --tp N`, one thread per process (gloo on CPU)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m",
         "cbgen", "run", *map(str, args), "--tp", str(processes)],
        env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )


# Instruction sets other CPU kinds have, imposed on this one (cbgen.config.cpu.HOLDS: torch's own kernels, oneDNN's,
# MKL's and cbgen's CPU-kind row). A hold only takes instructions away: a kind above the machine's own is skipped
# (pytest_under_isa says so), since its process would stop on instructions the CPU lacks.
OTHER_ISAS = {"avx2": HOLDS["avx2"], "avx512-no-bf16": HOLDS["avx512"]}
NO_AMX = HOLDS["avx512-bf16"]  # the AVX-512 BF16 machine without AMX (a Zen 4's instructions)


def pytest_under_isa(isa: str, test_file: str, selection: str, examples: int = 60) -> None:
    """Runs the tests `selection` (-k) of `test_file` in a fresh process held to another CPU kind's instructions
    (OTHER_ISAS), with `examples` examples per property, and asserts they passed. A kind above this CPU's own is
    skipped, saying so (its instructions are not there to run)."""
    import pytest

    from cbgen.config.cpu import unholdable_reason

    kind = OTHER_ISAS[isa]["CBGEN_CPU_KIND"]
    reason = unholdable_reason(kind)
    if reason is not None:
        pytest.skip(f"held to {kind}: {reason}")
    env = os.environ | OTHER_ISAS[isa] | {"CBGEN_PROPERTY_EXAMPLES": str(examples)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def property_examples(default: int) -> int:
    """How many examples a fast property draws (CBGEN_PROPERTY_EXAMPLES overrides, for the runs of pytest_under_isa)."""
    return int(os.environ.get("CBGEN_PROPERTY_EXAMPLES", default))


TWO_THREADS = 2  # what a test about thread counts compares one thread with


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to `count` for the block (a test about thread counts sets its own: the
    suite's workers run on one thread each, tests/conftest.py)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def fresh_caches(monkeypatch: Any, *names: str) -> None:
    """The process caches `names` (cbgen.process.runtime) empty for this test, as a fresh process has them, and what
    they held back after it (another test's kernels stay loaded)."""
    from cbgen.process.runtime import RUNTIME

    for name in names:
        cache = RUNTIME.named(name)
        monkeypatch.setattr(cache, "_store", type(cache._store)())


def q8_0_copy(source: Path, target: Path) -> Path:
    """A copy of the GGUF file `source` whose matrices are Q8_0 (requantized by the gguf package from their own
    dequantization) and whose metadata is the same but for the file type: a Q8_0 model file made without llama.cpp's
    converter."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = 7 if field.name == "general.file_type" else field.contents()  # 7: LlamaFileType.MOSTLY_Q8_0
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        values = quants.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        if values.ndim == 2 and values.shape[1] % 32 == 0:
            writer.add_tensor(tensor.name, quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
