"""The job configuration: defaults < YAML file < flags, validated before any model loads.

A job is described by six sections. `batching` mirrors transformers' `ContinuousBatchingConfig` field for field (its
field list is read from the installed class, so a new transformers field is reachable the day it appears); the other
sections are cbgen's own. Every value is checked where it enters, and the message names where it came from: the YAML
file and key (`job.yaml: batching.page_size ...`) or the flag (`--page-size ...`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from cbgen.errors import CbgenError


@dataclass
class ModelSection:
    model: str | None = None  # hub id, local folder or .gguf file; None = the embedded SmolLM2-135M-Instruct
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: str | None = None  # None = per device: per-sequence on CPU, flash/sdpa on CUDA
    trust_remote_code: bool = False
    # where converted GGUF models are cached; None = $CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen (~/.cache/cbgen)
    cache_dir: str | None = None
    use_cache: bool = True  # cache a GGUF model converted to safetensors, so later runs skip dequantizing it
    tp_size: int = 1  # tensor parallel: shard the model over this many processes (started by torchrun)


@dataclass
class InputSection:
    path: str | None = None
    prompt_column: str | None = None
    id_column: str | None = None
    keep_columns: list[str] = field(default_factory=list)
    raw_prompts: bool = False  # feed `prompt` text as is instead of as one user turn of the chat template
    # auto: from the path (OpenAI batch lines are recognised by their custom_id/body); or name it
    format: Literal["auto", "jsonl", "parquet", "openai", "dataset"] = "auto"
    split: str | None = None  # Hugging Face dataset split (default: train, or the only split)
    subset: str | None = None  # Hugging Face dataset configuration name (hub datasets)


@dataclass
class GenerationSection:
    max_new_tokens: int = 256
    do_sample: bool | None = None  # None: sample when a sampling parameter is set, else greedy
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_return_sequences: int = 1
    logprobs: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # strings that end a generation; the text is cut before them


@dataclass
class OutputSection:
    dir: str = "cbgen-out"
    format: Literal["jsonl", "parquet", "openai"] = "jsonl"
    rows_per_shard: int = 10_000
    overwrite: bool = False


@dataclass
class RunSection:
    max_in_flight: int | None = None  # None: 2 x max_requests_per_batch on CPU, 512 on CUDA
    quiet: bool = False
    request_timeout: float | None = None  # seconds from hand-over to the engine; None: no limit
    max_errors: int | None = None  # stop the job once more requests than this have failed; None: never
    commit_interval: float = 60.0  # seconds: commit the open shard at least this often, so a kill loses little
    num_shards: int | None = None  # split the input across this many jobs (default: the Slurm array size)
    shard_index: int | None = None  # which part this job runs, from 0 (default: the Slurm array task)
    prefix_gating: bool = True  # hold requests back until another request has computed their shared prefix


def _batching_fields() -> dict[str, dataclasses.Field]:
    from transformers.generation import ContinuousBatchingConfig

    return {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}


# ContinuousBatchingConfig fields that cbgen sets from another section, or that transformers has deprecated.
BATCHING_REDIRECTS = {
    "return_logprobs": "set generation.logprobs (or --logprobs) instead",
    "seed": "set generation.seed (or --seed) instead",
    "block_size": "deprecated in transformers: use batching.page_size",
    "use_default_compile_configs": "deprecated in transformers: use batching.default_compile_level",
    "max_cached_graphs": "deprecated in transformers and ignored: remove it",
}
SCHEDULERS = ("fifo", "prefill_first")

# Range checks beyond the type: (predicate, what the value must be).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "model.cache_dir": (lambda v: v.strip() != "", "a directory path"),
    "model.tp_size": (lambda v: v >= 1, "a positive integer (the number of processes torchrun starts)"),
    "batching.page_size": (lambda v: v >= 4, "an integer of at least 4"),
    "batching.num_blocks": (lambda v: v >= 1, "a positive integer"),
    "batching.max_batch_tokens": (lambda v: v >= 1, "a positive integer"),
    "batching.max_requests_per_batch": (lambda v: v >= 1, "a positive integer"),
    "batching.max_blocks_per_request": (lambda v: v >= 0, "an integer of at least 0 (0 turns the fast path off)"),
    "batching.max_memory_percent": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "batching.safety_margin": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "batching.default_compile_level": (lambda v: 0 <= v <= 3, "an integer from 0 to 3"),
    "batching.cpu_offload_space": (lambda v: v >= 0, "a size in GiB, at least 0"),
    "batching.cpu_offload_space_safety_threshold": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "batching.max_queue_size": (lambda v: v >= 0, "an integer of at least 0 (0 = unlimited)"),
    "batching.q_padding_interval_size": (lambda v: v >= 0, "an integer of at least 0"),
    "batching.kv_padding_interval_size": (lambda v: v >= 0, "an integer of at least 0"),
    "batching.cpu_group_timeout": (lambda v: v > 0, "a positive number of seconds"),
    "batching.scheduler_type": (lambda v: v in SCHEDULERS, "one of: fifo, prefill_first"),
    "generation.max_new_tokens": (lambda v: v >= 1, "a positive integer"),
    "generation.temperature": (lambda v: v > 0, "a positive number (use --greedy for temperature 0)"),
    "generation.top_p": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "generation.top_k": (lambda v: v >= 1, "a positive integer"),
    "generation.num_return_sequences": (lambda v: v >= 1, "a positive integer"),
    "generation.stop_token_ids": (lambda v: all(t >= 0 for t in v), "a list of token ids (integers >= 0)"),
    "generation.stop": (lambda v: all(s != "" for s in v), "a list of non-empty strings"),
    "input.split": (lambda v: v.strip() != "", "a split name such as train"),
    "input.subset": (lambda v: v.strip() != "", "a configuration name"),
    "output.rows_per_shard": (lambda v: v >= 1, "a positive integer"),
    "run.max_in_flight": (lambda v: v >= 1, "a positive integer"),
    "run.request_timeout": (lambda v: v > 0, "a positive number of seconds"),
    "run.max_errors": (lambda v: v >= 0, "an integer of at least 0"),
    "run.commit_interval": (lambda v: v > 0, "a positive number of seconds"),
    "run.num_shards": (lambda v: v >= 1, "a positive integer"),
    "run.shard_index": (lambda v: v >= 0, "an integer of at least 0"),
}

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "input": InputSection,
    "generation": GenerationSection,
    "batching": dict,  # ContinuousBatchingConfig fields, only those set by the user
    "output": OutputSection,
    "run": RunSection,
}


@dataclass
class JobConfig:
    """Everything a job needs, validated. `batching` holds only the ContinuousBatchingConfig fields the user set."""

    model: ModelSection = field(default_factory=ModelSection)
    input: InputSection = field(default_factory=InputSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    batching: dict[str, Any] = field(default_factory=dict)
    output: OutputSection = field(default_factory=OutputSection)
    run: RunSection = field(default_factory=RunSection)

    @property
    def do_sample(self) -> bool:
        g = self.generation
        if g.do_sample is not None:
            return g.do_sample
        return any(v is not None for v in (g.temperature, g.top_p, g.top_k))

    def to_dict(self) -> dict[str, Any]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS if name != "batching"}
        out["batching"] = dict(self.batching)
        return {name: out[name] for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------------------------------------- #
# Value checking


def _describe(tp: Any) -> str:
    """A short, human name for a type annotation."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}s"
    if origin is tuple:
        return "a pair of booleans"
    return {int: "integer", float: "number", bool: "true/false", str: "text"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any) -> Any:
    """Returns `value` as type `tp`, or raises ValueError. Only lossless conversions (an int where a float goes)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing) | {"CompileConfig": dict})  # string annotations from `from __future__`
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except ValueError:
                pass
        raise ValueError
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ValueError
    if origin is list:
        if not isinstance(value, list):
            raise ValueError
        return [_coerce(v, get_args(tp)[0]) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, bool) for v in value):
            raise ValueError
        return tuple(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if tp is dict or getattr(tp, "__name__", "") == "CompileConfig":
        if isinstance(value, dict):
            return value
        raise ValueError
    raise ValueError


def _field_types(section: str) -> dict[str, Any]:
    if section == "batching":
        return {name: f.type for name, f in _batching_fields().items()}
    return typing.get_type_hints(SECTIONS[section])


def check_value(section: str, key: str, value: Any, where: str) -> Any:
    """Validates one value and returns it normalised. `where` prefixes the message: 'job.yaml: batching.page_size'
    or '--page-size'."""
    types_ = _field_types(section)
    if section == "batching" and key in BATCHING_REDIRECTS:
        raise CbgenError(f"{where}: {BATCHING_REDIRECTS[key]}")
    if key not in types_:
        allowed = sorted(k for k in types_ if k not in BATCHING_REDIRECTS)
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise CbgenError(f"{where}: unknown key '{key}' in section '{section}'; {hint}allowed: {', '.join(allowed)}")
    if section == "batching" and key == "scheduler_type" and isinstance(value, str):
        value = value.replace("-", "_")
    tp = types_[key]
    try:
        value = _coerce(value, tp)
    except ValueError:
        check = _CHECKS.get(f"{section}.{key}")
        expected = check[1] if check else _describe(tp)
        raise CbgenError(f"{where} must be {expected} (got {value!r})") from None
    check = _CHECKS.get(f"{section}.{key}")
    if check and value is not None and not check[0](value):
        raise CbgenError(f"{where} must be {check[1]} (got {value!r})")
    return value


# ----------------------------------------------------------------------------------------------------------------- #
# Building a configuration


def read_yaml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Reads a job file into {section: {key: value}}, checking every key and value; errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CbgenError(f"config file '{path}' does not exist; create one with `cbgen config init {path}`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CbgenError(f"config file '{path}' cannot be read: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise CbgenError(f"{path}{line}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CbgenError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    result: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SECTIONS:
            close = difflib.get_close_matches(str(section), list(SECTIONS), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise CbgenError(f"{path}: unknown section '{section}'; {hint}allowed: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise CbgenError(f"{path}: section '{section}' must be a mapping of keys to values")
        result[section] = {
            key: check_value(section, key, value, f"{path}: {section}.{key}") for key, value in values.items()
        }
    return result


def build_config(
    config_file: str | Path | None = None, overrides: dict[tuple[str, str], tuple[Any, str]] | None = None
) -> JobConfig:
    """Builds the effective configuration: defaults, then the YAML file, then `overrides`.

    `overrides` maps (section, key) to (value, flag name); only flags the user actually gave belong there.
    """
    layers: dict[str, dict[str, Any]] = read_yaml(config_file) if config_file else {}
    for (section, key), (value, flag) in (overrides or {}).items():
        layers.setdefault(section, {})[key] = check_value(section, key, value, flag)
    job = JobConfig()
    for section, values in layers.items():
        if section == "batching":
            job.batching.update(values)
        else:
            target = getattr(job, section)
            for key, value in values.items():
                setattr(target, key, value)
    check_combinations(job)
    return job


def check_combinations(job: JobConfig) -> None:
    """Rejects settings that are each valid but cannot go together, saying what to change."""
    g = job.generation
    sampling = [name for name in ("temperature", "top_p", "top_k") if getattr(g, name) is not None]
    if g.do_sample is False and sampling:
        flags = ", ".join(f"--{s.replace('_', '-')}" for s in sampling)
        raise CbgenError(f"greedy decoding ignores {flags}: drop --greedy (do_sample: false) or drop {flags}")
    r = job.run
    if (r.shard_index is None) != (r.num_shards is None):
        raise CbgenError("--num-shards and --shard-index go together: give both, or neither (Slurm arrays set them)")
    if r.num_shards is not None and r.shard_index >= r.num_shards:
        raise CbgenError(f"--shard-index {r.shard_index} must be below --num-shards {r.num_shards} (counted from 0)")
    if g.num_return_sequences > 1 and not job.do_sample:
        raise CbgenError(
            f"--num-return-sequences {g.num_return_sequences} needs sampling (greedy would return the same text "
            f"{g.num_return_sequences} times): add --do-sample or --temperature, or use --num-return-sequences 1"
        )


CONFIG_TEMPLATE = """\
# cbgen job file. Precedence: built-in defaults < this file < command-line flags.
# Show the effective configuration with: cbgen config show --config THIS_FILE

model:
  model: null            # hub id, local folder, .gguf file, or random weights: a config.json or a shape name
                         # (llama-1b, llama-3b, llama-8b, qwen3-0.6b, qwen3-4b, smollm2-135m, ...);
                         # null = the embedded SmolLM2-135M-Instruct
  dtype: auto            # auto | bfloat16 | float16 | float32 (auto: bfloat16 on CUDA and on CPUs with bf16 units)
  device: auto           # auto | cpu | cuda
  attn_implementation: null   # null = per-sequence on CPU; flash_attention_2 on CUDA when installed, else sdpa
  trust_remote_code: false
  cache_dir: null        # cache of converted GGUF models; null = $CBGEN_CACHE_DIR, else ~/.cache/cbgen
  use_cache: true        # false: dequantize a GGUF model on every run instead
  tp_size: 1             # tensor parallel over this many processes: torchrun --nproc-per-node N -m cbgen run ...

input:
  path: null             # JSONL, Parquet, OpenAI batch file, dataset folder or hub id; '-' = JSONL on stdin
  prompt_column: null    # null = each row's prompt, messages or input_ids field
  id_column: null        # null = row number
  keep_columns: []       # input columns copied into every output row
  raw_prompts: false     # true: feed 'prompt' text as is, without the chat template
  format: auto           # auto | jsonl | parquet | openai (Batch API lines) | dataset (Hugging Face)
  split: null            # dataset split; null = train, or the only one
  subset: null           # dataset configuration name (hub datasets)

generation:
  max_new_tokens: 256
  do_sample: null        # null = sample when temperature, top_p or top_k is set
  temperature: null
  top_p: null
  top_k: null
  seed: null
  num_return_sequences: 1
  logprobs: false        # log-probability of each generated token
  stop_token_ids: []     # extra token ids that end a generation, besides the model's end-of-sequence tokens
  stop: []               # strings that end a generation; the text is cut before the first one that appears

batching:                # transformers' ContinuousBatchingConfig; leave a key out to let cbgen / transformers decide
  # page_size: 256               # tokens per KV-cache page (at least 4)
  # num_blocks: null             # KV-cache size in blocks of page_size tokens; cbgen sizes it from the job
  # max_memory_percent: null     # size the KV cache as this share of free (device) memory instead
  # max_batch_tokens: null       # token budget of one forward pass (prefill chunking)
  # max_requests_per_batch: null # requests in one forward pass
  # max_blocks_per_request: null # block table size for the flash decode fast path; 0 turns it off
  # allow_block_sharing: true    # reuse KV blocks of shared prompt prefixes
  # scheduler_type: fifo         # fifo | prefill_first
  # safety_margin: null          # share of the cache kept free for running requests (fifo: 0.15)
  # use_cuda_graph: null         # true | false | [varlen, decode]; null = decided by transformers
  # use_async_batching: null     # overlap CPU scheduling with GPU compute (needs CUDA graphs)
  # q_padding_interval_size: 0   # CUDA graph query padding granularity (0 = preset)
  # kv_padding_interval_size: 0  # CUDA graph KV padding granularity (0 = preset)
  # default_compile_level: 0     # torch.compile level 0-3
  # varlen_compile_config: null  # CompileConfig fields as a mapping, e.g. {mode: default, dynamic: true}
  # decode_compile_config: null
  # auto_switch_to_flash: true   # use flash attention instead of sdpa/eager when it is installed
  # cpu_offload_space: 0.0       # GiB of CPU memory to swap evicted KV blocks into
  # cpu_offload_space_safety_threshold: 0.8
  # max_queue_size: 0            # 0 = unlimited
  # per_request_processors: false
  # drop_unsupported_processors: true
  # disable_nccl_graph_mixing: true
  # cpu_group_timeout: 300.0     # seconds, tensor-parallel coordination timeout

output:
  dir: cbgen-out
  format: jsonl          # jsonl | parquet | openai (one Batch API output line per request)
  rows_per_shard: 10000
  overwrite: false       # true: delete earlier results in dir first

run:
  max_in_flight: null    # requests handed to the engine at once; null = 2 x max_requests_per_batch on CPU
  quiet: false
  request_timeout: null  # seconds a request may take once handed to the engine; null = no limit
  max_errors: null       # stop once more requests than this have failed; null = never
  commit_interval: 60.0  # seconds between commits of the open shard, so a killed run loses little
  num_shards: null       # split the input across this many jobs (default: the Slurm array size)
  shard_index: null      # this job's part, from 0 (default: the Slurm array task)
  prefix_gating: true    # admit a shared prefix's followers once its first request has computed it
"""
