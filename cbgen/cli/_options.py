"""The job options shared by `cbgen run` and `cbgen config show`, declared once.

Each option maps to one (section, key) of the job configuration. A command decorated with `@job_options` receives
the flags the user actually gave as `overrides`, ready for `cbgen.config.build_config`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import typer

PANEL_MODEL = "Model"
PANEL_INPUT = "Input"
PANEL_GENERATION = "Generation"
PANEL_BATCHING = "Continuous batching (transformers' ContinuousBatchingConfig)"
PANEL_OUTPUT = "Output"
PANEL_RUN = "Run"


@dataclass(frozen=True)
class JobOption:
    section: str
    key: str
    flags: tuple[str, ...]
    type: Any
    help: str
    panel: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def param_name(self) -> str:
        return f"{self.section}__{self.key}"


JOB_OPTIONS: list[JobOption] = [
    # Model
    JobOption("model", "model", ("--model", "-m"), str,
              "Hub id, local model folder, or .gguf file (its tokenizer comes from the same file); or random "
              "weights for benchmarking: a config.json, or a shape name (llama-1b, llama-3b, llama-8b, qwen3-0.6b, "
              "qwen3-1.7b, qwen3-4b, qwen3-8b, smollm2-135m). Default: the embedded SmolLM2-135M-Instruct.",
              PANEL_MODEL, metavar="MODEL"),
    JobOption("model", "dtype", ("--dtype",), str,
              "Weight and activation precision. auto: bfloat16 on CUDA and on CPUs with bf16 matrix units, "
              "else float32.", PANEL_MODEL, choices=("auto", "bfloat16", "float16", "float32")),
    JobOption("model", "device", ("--device",), str, "Where the model runs. auto: CUDA when visible.",
              PANEL_MODEL, choices=("auto", "cpu", "cuda")),
    JobOption("model", "attn_implementation", ("--attn-implementation",), str,
              "Attention: per-sequence (cbgen's CPU attention for continuous batching: each request attends "
              "only to its own KV), sdpa, paged|eager, or a flash_attention_* name. Default: per-sequence on CPU "
              "where the model allows it, else sdpa; flash_attention_2 on CUDA when installed, else sdpa.",
              PANEL_MODEL, metavar="NAME"),
    JobOption("model", "trust_remote_code", ("--trust-remote-code/--no-trust-remote-code",), bool,
              "Allow the model folder's own Python code to run. Off unless you trust its author.", PANEL_MODEL),
    JobOption("model", "cache_dir", ("--model-cache-dir",), str,
              "Where GGUF models converted to safetensors are cached, so only the first run dequantizes them. "
              "Default: $CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen (~/.cache/cbgen).", PANEL_MODEL, metavar="DIR"),
    JobOption("model", "use_cache", ("--model-cache/--no-model-cache",), bool,
              "Use (and fill) the converted-GGUF cache; --no-model-cache dequantizes the GGUF file every run.",
              PANEL_MODEL),
    JobOption("model", "tp_size", ("--tp",), int,
              "Tensor parallel: shard the model over N processes, started with `torchrun --nproc-per-node N -m "
              "cbgen run ... --tp N` (gloo on CPU, NCCL on GPUs). Rank 0 reads the input, writes the output and "
              "shows progress. A model whose attention heads do not split N ways shards only its MLP and "
              "embeddings.  [default: 1]", PANEL_MODEL, metavar="N"),
    # Input
    JobOption("input", "format", ("--input-format",), str,
              "What the input is. auto: from the path: .jsonl/.json/.ndjson (OpenAI Batch API lines are "
              "recognised by their custom_id and body), .parquet, a folder of them, a dataset saved with "
              "save_to_disk, or a Hugging Face hub dataset id.  [default: auto]", PANEL_INPUT,
              choices=("auto", "jsonl", "parquet", "openai", "dataset")),
    JobOption("input", "split", ("--split",), str,
              "Dataset split to read (Hugging Face datasets). Default: train, or the only split.", PANEL_INPUT,
              metavar="NAME"),
    JobOption("input", "subset", ("--subset",), str,
              "Dataset configuration (subset) name, for hub datasets that have several.", PANEL_INPUT,
              metavar="NAME"),
    JobOption("input", "prompt_column", ("--prompt-column",), str,
              "Field holding the prompt: text, a list of chat messages, or token ids. "
              "Default: each row's 'prompt', 'messages' or 'input_ids'.", PANEL_INPUT, metavar="NAME"),
    JobOption("input", "id_column", ("--id-column",), str,
              "Field holding a unique id per row, copied to the output. Default: the row number (from 0).",
              PANEL_INPUT, metavar="NAME"),
    JobOption("input", "keep_columns", ("--keep-columns",), list[str],
              "Input fields copied into every output row; comma-separated or repeated.", PANEL_INPUT,
              metavar="A,B"),
    JobOption("input", "raw_prompts", ("--raw-prompts/--chat-prompts",), bool,
              "Tokenize 'prompt' text as is, instead of as one user turn of the model's chat template "
              "(the default when the tokenizer has one).", PANEL_INPUT),
    # Generation
    JobOption("generation", "max_new_tokens", ("--max-new-tokens",), int,
              "Most tokens generated per sequence.  [default: 256]", PANEL_GENERATION),
    JobOption("generation", "do_sample", ("--do-sample/--greedy",), bool,
              "Sample the next token, or always take the most likely one. Default: sample when "
              "--temperature, --top-p or --top-k is given, else greedy.", PANEL_GENERATION),
    JobOption("generation", "temperature", ("--temperature", "-t"), float,
              "Sampling temperature (> 0); lower is more deterministic.", PANEL_GENERATION),
    JobOption("generation", "top_p", ("--top-p",), float,
              "Sample only from the smallest set of tokens whose probabilities add up to this (0-1].",
              PANEL_GENERATION),
    JobOption("generation", "top_k", ("--top-k",), int, "Sample only from the k most likely tokens.",
              PANEL_GENERATION),
    JobOption("generation", "seed", ("--seed",), int,
              "Seed for sampling, repeatable run to run. A request's samples still depend on which requests "
              "share its batches.", PANEL_GENERATION),
    JobOption("generation", "num_return_sequences", ("--num-return-sequences", "-n"), int,
              "Sequences per prompt (needs sampling); each is an output row with its sample_index.  [default: 1]",
              PANEL_GENERATION),
    JobOption("generation", "logprobs", ("--logprobs/--no-logprobs",), bool,
              "Write the log-probability of every generated token.", PANEL_GENERATION),
    JobOption("generation", "stop_token_ids", ("--stop-token-id",), list[int],
              "Extra token id that ends a sequence, besides the model's end-of-sequence tokens; repeatable.",
              PANEL_GENERATION, metavar="ID"),
    JobOption("generation", "stop", ("--stop",), list[str],
              "A string that ends a sequence as soon as it appears (the request is cancelled then, not run to "
              "--max-new-tokens); the text is cut before it and finish_reason is 'stop'. Repeatable; rows may "
              "add their own with a 'stop' field.", PANEL_GENERATION, metavar="TEXT"),
    # Continuous batching
    JobOption("batching", "page_size", ("--page-size",), int,
              "Tokens per KV-cache page (at least 4). Smaller pages waste less memory on short requests; "
              "larger ones mean less bookkeeping.  [default: 256]", PANEL_BATCHING),
    JobOption("batching", "max_batch_tokens", ("--max-batch-tokens",), int,
              "Token budget of one forward pass; longer prompts are prefilled in chunks. "
              "Default: 1024 on CPU, from free memory on GPU.", PANEL_BATCHING),
    JobOption("batching", "max_requests_per_batch", ("--max-requests-per-batch",), int,
              "Most requests in one forward pass. Default on CPU: 64 with the per-sequence attention, 16 with "
              "the stock one; on GPU, from the workload.", PANEL_BATCHING),
    JobOption("batching", "num_blocks", ("--num-blocks",), int,
              "KV-cache size in blocks of --page-size tokens. Default: on CPU, sized by cbgen for the requests "
              "in flight; on GPU, from free memory.", PANEL_BATCHING),
    JobOption("batching", "max_memory_percent", ("--max-memory-percent",), float,
              "Size the KV cache as this share (0-1] of free device memory instead (on CPU: of system RAM).",
              PANEL_BATCHING),
    JobOption("batching", "scheduler_type", ("--scheduler",), str,
              "fifo admits requests in order and keeps a safety margin of free cache; prefill-first "
              "favours starting new requests.", PANEL_BATCHING, choices=("fifo", "prefill-first")),
    JobOption("batching", "safety_margin", ("--safety-margin",), float,
              "Share [0-1] of the cache kept free for running requests before new ones are admitted "
              "(fifo default 0.15, prefill-first 0).", PANEL_BATCHING),
    JobOption("batching", "use_cuda_graph", ("--use-cuda-graph/--no-cuda-graph",), bool,
              "Record and replay CUDA graphs (GPU only). Default: decided by transformers.", PANEL_BATCHING),
    JobOption("batching", "default_compile_level", ("--compile-level",), int,
              "torch.compile level 0-3 for the forward passes: higher is faster after a longer warm-up.",
              PANEL_BATCHING),
    JobOption("batching", "cpu_offload_space", ("--cpu-offload-space",), float,
              "GiB of host memory to swap evicted KV blocks into instead of recomputing them (GPU).",
              PANEL_BATCHING),
    # Output
    JobOption("output", "dir", ("--output-dir", "-o"), str, "Directory for the shards and run.json.  "
              "[default: cbgen-out]", PANEL_OUTPUT, metavar="DIR"),
    JobOption("output", "format", ("--output-format",), str,
              "Shard format: jsonl or parquet (a row per sequence, readable with datasets.load_dataset), or "
              "openai (a line per request, as OpenAI's Batch API output file has it).  [default: jsonl]",
              PANEL_OUTPUT, choices=("jsonl", "parquet", "openai")),
    JobOption("output", "rows_per_shard", ("--rows-per-shard",), int,
              "Rows per shard file; a shard appears under its final name only once complete.  [default: 10000]",
              PANEL_OUTPUT),
    JobOption("output", "overwrite", ("--overwrite/--no-overwrite",), bool,
              "Delete the results of an earlier run in the output directory first.", PANEL_OUTPUT),
    # Run
    JobOption("run", "max_in_flight", ("--max-in-flight",), int,
              "Requests handed to the engine at once; results are written as they finish, so memory stays "
              "bounded. Default: twice --max-requests-per-batch (512 when transformers chooses that).", PANEL_RUN),
    JobOption("run", "quiet", ("--quiet/--no-quiet", "-q"), bool,
              "No progress display and no summary; errors are still printed.", PANEL_RUN),
    JobOption("run", "request_timeout", ("--request-timeout",), float,
              "Seconds a request may take once handed to the engine; a slower one is cancelled and recorded "
              "as failed.", PANEL_RUN, metavar="SECONDS"),
    JobOption("run", "max_errors", ("--max-errors",), int,
              "Stop the job (resumable) once more than this many requests have failed.", PANEL_RUN),
    JobOption("run", "commit_interval", ("--commit-interval",), float,
              "Commit the open shard at least every this many seconds, so a killed job loses little work.  "
              "[default: 60]", PANEL_RUN, metavar="SECONDS"),
    JobOption("run", "num_shards", ("--num-shards",), int,
              "Split the input into this many parts by a stable hash of the id, one per job; each writes to "
              "DIR/shard-IIIII-of-NNNNN. Default: the Slurm array size (SLURM_ARRAY_TASK_COUNT).", PANEL_RUN),
    JobOption("run", "prefix_gating", ("--prefix-gating/--no-prefix-gating",), bool,
              "Admit the first request of each shared prompt prefix, and the others once it has computed the "
              "prefix, so they reuse its KV cache instead of all computing it at once.  [default: on]", PANEL_RUN),
    JobOption("run", "shard_index", ("--shard-index",), int,
              "Which part this job runs, from 0. Default: the Slurm array task (SLURM_ARRAY_TASK_ID minus "
              "SLURM_ARRAY_TASK_MIN).", PANEL_RUN),
]


def _parameter(option: JobOption) -> inspect.Parameter:
    kwargs: dict[str, Any] = {"help": option.help, "rich_help_panel": option.panel, "show_default": False}
    if option.metavar:
        kwargs["metavar"] = option.metavar
    value_type = Literal[option.choices] if option.choices else option.type
    annotation = Annotated[Optional[value_type], typer.Option(*option.flags, **kwargs)]  # noqa: UP045 (typer)
    return inspect.Parameter(option.param_name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _normalise(option: JobOption, value: Any) -> Any:
    if option.key == "keep_columns":
        return [name.strip() for item in value for name in item.split(",") if name.strip()]
    return value


def job_options(command):
    """Adds every job option to `command`'s signature; the command gets the given ones as `overrides`."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "overrides"]

    @functools.wraps(command)
    def wrapper(**kwargs):
        overrides = {}
        for option in JOB_OPTIONS:
            value = kwargs.pop(option.param_name, None)
            if value is not None and value != []:
                overrides[(option.section, option.key)] = (_normalise(option, value), option.flags[0].split("/")[0])
        return command(overrides=overrides, **kwargs)

    wrapper.__signature__ = inspect.Signature(own + [_parameter(o) for o in JOB_OPTIONS])
    return wrapper


ConfigFile = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--config", "-c", help="YAML job file (sections model, input, generation, batching, output, run); "
                 "flags override it. Start from `cbgen config init`.", metavar="FILE"),
]
