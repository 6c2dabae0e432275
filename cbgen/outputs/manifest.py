"""What a run directory says about its job: the fingerprint (what changes the results, compared on every resume)
and run.json (what the run did: configuration, model, versions, counts, timings, throughput)."""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen import __version__
from cbgen.config import JobConfig
from cbgen.files import write_json_atomic
from cbgen.kinds import DEFAULT, kind_of
from cbgen.model import dtype_name
from cbgen.model.source import ModelSource
from cbgen.outputs.summary import RunSummary
from cbgen.rows.rundir import FORMAT, MANIFEST_FILE, redo_history

if TYPE_CHECKING:
    from cbgen.model.load import LoadedModel

_SAMPLE = 1 << 20  # bytes hashed at each end of an input file to recognise it


def input_identity(path: str | None, memo: Path | None = None) -> dict[str, Any]:
    """What makes an input the same input: its size, the digest of every byte (each file hashed once and
    remembered by size and mtime in `memo`) and of its first and last MiB (what runs before format 3 compared); not
    its path, so a moved file still resumes; not its mtime, which copies and checkouts change. A hub dataset is its
    id and resolved revision. Stdin has no identity (a resume needs --same-input)."""
    from cbgen.files import file_digest

    if path is None or path == "-":
        return {"source": "stdin"}
    target = Path(path)
    if not target.exists():
        from cbgen.model.source import hub_commit

        return {"hub_dataset": path, "revision": hub_commit(path, "dataset")}
    # a folder: its data files (Parquet files, a dataset saved with save_to_disk, a dataset repository's files)
    files = sorted(p for p in target.rglob("*") if p.is_file() and not p.name.startswith(".")) \
        if target.is_dir() else [target]
    digest, whole = hashlib.sha256(), hashlib.sha256()
    size = 0
    for file in files:
        file_size = file.stat().st_size
        size += file_size
        whole.update(file_digest(file, memo).encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if file_size > _SAMPLE:
                f.seek(max(_SAMPLE, file_size - _SAMPLE))
                digest.update(f.read(_SAMPLE))
    return {"files": len(files), "bytes": size, "sha256_head_tail": digest.hexdigest(), "sha256": whole.hexdigest()}


def cut_identity(path: str, size: int | None = None) -> dict[str, Any]:
    """The identity of an input that ended early (a cut gzip stream): its first `size` bytes (by default, all of
    it, as cut). A run that stopped on the cut records this, so that the file made whole, which begins with the
    same bytes, resumes it."""
    target = Path(path)
    size = target.stat().st_size if size is None else size
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        digest.update(f.read(size))
    return {"cut_at_bytes": size, "sha256_before_cut": digest.hexdigest()}


def job_fingerprint(job: JobConfig, source: ModelSource, sharding: tuple[int, int] | None) -> dict[str, Any]:
    """The settings that change what a run writes. Batching and run settings change speed, not results, so a
    resume may change them; bf16 greedy tokens can still drift with batch composition (docs/generation.md)."""
    from cbgen.cache_root import default_cache_dir
    from cbgen.model.adapters import job_adapters
    from cbgen.render.templates import PromptTemplate

    g, i = job.generation, job.input
    template = PromptTemplate.from_input(i)
    memo = default_cache_dir(job.model) / "digests.json"  # file digests, remembered by size and mtime
    fingerprint = {
        "model": source.identity(memo),
        "dtype": job.model.dtype,
        "onednn_linear": job.model.onednn_linear,
        **({"quantize": job.model.quantize} if job.model.quantize != "auto" else {}),
        "batch_invariant": job.model.batch_invariant,
        "input": input_identity(i.path, memo),
        "prompt_column": i.prompt_column,
        "id_column": i.id_column,
        "keep_columns": list(i.keep_columns),
        "raw_prompts": i.raw_prompts,
        "templates": template.to_dict() if template is not None else None,  # their text: a changed one is a new job
        "input_format": i.format,
        "split": i.split,
        "subset": i.subset,
        "generation": {**dataclasses.asdict(g), "do_sample": job.do_sample},
        "output_format": job.output.format,
        "shard": list(sharding) if sharding else None,
    }
    adapters = job_adapters(job)
    if adapters is not None:  # by content: other weights under the same path are another job
        fingerprint["adapters"] = adapters.identity(memo)
    return kind_of(job.kind).fingerprint(job, fingerprint)


def package_versions() -> dict[str, str]:
    """The versions that shaped the results; only those already imported (a run that loaded no model has no torch
    to report, and importing it just to say so would cost seconds)."""
    versions = {"cbgen": __version__, "python": platform.python_version()}
    for name in ("transformers", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = module.__version__
    return versions


def _cpu_defaults(loaded: LoadedModel | None) -> dict[str, Any] | None:
    """The CPU-kind row whose dtype and batching defaults a CPU run started from (flags and YAML override them)."""
    if loaded is None or loaded.device != "cpu":
        return None
    from cbgen.config.cpu import cpu_row

    return cpu_row().describe()


def write_manifest(summary: RunSummary, job: JobConfig, loaded: LoadedModel | None, batching: dict) -> Path:
    """Writes run.json beside the shards."""
    model: dict[str, Any] = {"name": summary.model}
    if loaded is not None:
        model |= {"device": loaded.device, "dtype": dtype_name(loaded.dtype),
                  "attn_implementation": loaded.attn_implementation, "cache": loaded.cache,
                  "random_weights": loaded.random_weights, "linear": summary.engine_scope.get("linear")}
        if loaded.quantized is not None:
            model["quantized"] = loaded.quantized
        elif loaded.source.gguf_file:
            why = ("--quantize none" if job.model.quantize == "none" else "adapters or --tp" if
                   job.model.adapter is not None or job.model.tp_size > 1 else "the file's weight type is not Q8_0")
            model["quantized"] = f"dequantized to float ({why})"
    adapters = adapters_record(job)
    if adapters:
        model["adapters"] = adapters
    manifest = {
        "format": FORMAT,
        "cbgen_version": __version__,
        "status": summary.status,
        "kind": job.kind,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "shard": {"index": summary.shard[0], "count": summary.shard[1]} if summary.shard else None,
        "model": model,
        "ids": summary.ids.to_dict() if summary.ids else None,
        "attention": summary.attention,
        "batch_invariant": summary.batch_invariant or None,
        "engine_scope": summary.engine_scope or None,  # what cbgen installed into transformers and torch, from the plan
        "config": job.to_dict(),
        "continuous_batching": batching,
        "cpu_defaults": _cpu_defaults(loaded),
        "kv_cache": summary.kv_cache,
        "versions": package_versions(),
        "counts": summary.counts(),
        "engine_restarts": summary.engine_restarts,
        "sampling": summary.sampling,
        "step_control": summary.step_control,
        "replicas": summary.replicas,
        "result_cache": summary.result_cache or None,  # this run's hits and misses (docs/cache.md)
        **({"scorer": summary.scorer} if not kind_of(job.kind).generates else {}),
        "input_notices": summary.input_notices,
        "timings": summary.timings,
        "throughput": summary.throughput(),
        "shards": summary.shards,
        "redos": redo_history(summary.output_dir),  # --redo: which ran, when, with what settings, how much
    }
    path = summary.output_dir / MANIFEST_FILE
    write_json_atomic(path, manifest)
    return path


def adapters_record(job: JobConfig) -> list[dict[str, Any]]:
    """run.json's and the dataset card's account of the job's LoRA adapters: each one's name, source, rank, targets
    and digests, the job's own (the rows that name none run with it) marked `default`."""
    from cbgen.cache_root import default_cache_dir
    from cbgen.model.adapters import job_adapters

    adapters = job_adapters(job)
    if adapters is None:
        return []
    memo = default_cache_dir(job.model) / "digests.json"
    return [a.describe() | a.identity(memo) | {"default": a is adapters.default} for a in adapters.all]


def stored_job(job: JobConfig) -> dict:
    """The configuration kept beside the fingerprint, with the input's absolute path, so that `cbgen status` and
    `cbgen merge` find it from any directory."""
    stored = job.to_dict()
    if job.kind != DEFAULT:  # stored when not the default, as runs before kinds were stored read back
        stored["kind"] = job.kind
    if job.input.path is not None and Path(job.input.path).exists():
        stored["input"]["path"] = str(Path(job.input.path).resolve())
    for key in ("template", "system"):  # @FILE templates, found from any directory too
        value = stored["input"].get(key)
        if isinstance(value, str) and value.startswith("@") and Path(value[1:]).expanduser().exists():
            stored["input"][key] = "@" + str(Path(value[1:]).expanduser().resolve())
    return stored
