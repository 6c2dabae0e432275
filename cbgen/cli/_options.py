"""The job options shared by `cbgen run` and `cbgen config show`, declared once.

Each option maps to one (section, key) of the job configuration, whose help text and default it shows (they live
in cbgen.config.sections, beside the defaults themselves). A command decorated with `@job_options` receives the
flags the user actually gave as `overrides`, ready for `cbgen.config.build_config`.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import typer

from cbgen.config import SECTIONS
from cbgen.config.sections import default_of, help_of

PANEL_MODEL = "Model"
PANEL_INPUT = "Input"
PANEL_GENERATION = "Generation"
PANEL_STRUCTURED = "Structured outputs"
PANEL_BATCHING = "Continuous batching (transformers' ContinuousBatchingConfig)"
PANEL_OUTPUT = "Output"
PANEL_RUN = "Run"


@dataclass(frozen=True)
class JobOption:
    section: str
    key: str
    flags: tuple[str, ...]
    type: Any
    panel: str
    choices: tuple[str, ...] | None = None  # default: the values of the setting's Literal type, if it has one
    metavar: str | None = None

    @property
    def param_name(self) -> str:
        return f"{self.section}__{self.key}"

    @property
    def help(self) -> str:
        """The setting's own help text, what a list flag takes, and its default when it has a fixed one."""
        text = help_of(self.section, self.key)
        if typing.get_origin(self.type) is list and "repeat" not in text:
            text += " Repeatable."
        default = default_of(self.section, self.key)
        if default is not None and default != []:
            shown = self._flag_for(default) if isinstance(default, bool) else str(default)
            text += f"  [default: {shown}]"
        return text

    def _flag_for(self, value: bool) -> str:
        """The flag of an --on/--off pair that gives `value`."""
        on, _, off = self.flags[0].partition("/")
        return on if value or not off else off

    @property
    def values(self) -> tuple[str, ...] | None:
        if self.choices or self.section == "batching":
            return self.choices
        annotation = typing.get_type_hints(SECTIONS[self.section])[self.key]
        return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


JOB_OPTIONS: list[JobOption] = [
    JobOption("model", "model", ("--model", "-m"), str, PANEL_MODEL, metavar="MODEL"),
    JobOption("model", "dtype", ("--dtype",), str, PANEL_MODEL),
    JobOption("model", "device", ("--device",), str, PANEL_MODEL),
    JobOption("model", "attn_implementation", ("--attn-implementation",), str, PANEL_MODEL, metavar="NAME"),
    JobOption("model", "adapter", ("--adapter",), list[str], PANEL_MODEL, metavar="[NAME=]PATH"),
    JobOption("model", "adapter_any_base", ("--adapter-any-base/--adapter-same-base",), bool, PANEL_MODEL),
    JobOption("model", "trust_remote_code", ("--trust-remote-code/--no-trust-remote-code",), bool, PANEL_MODEL),
    JobOption("model", "cache_dir", ("--model-cache-dir",), str, PANEL_MODEL, metavar="DIR"),
    JobOption("model", "use_cache", ("--model-cache/--no-model-cache",), bool, PANEL_MODEL),
    JobOption("model", "onednn_linear", ("--onednn-linear/--stock-linear",), bool, PANEL_MODEL),
    JobOption("model", "quantize", ("--quantize",), str, PANEL_MODEL),
    JobOption("model", "linear_row_buckets", ("--linear-row-buckets/--no-linear-row-buckets",), bool, PANEL_MODEL),
    JobOption("model", "fused_layers", ("--fused-layers/--no-fused-layers",), bool, PANEL_MODEL),
    JobOption("model", "compiled_linear", ("--compiled-linear/--no-compiled-linear",), bool, PANEL_MODEL),
    JobOption("model", "compiled_attention", ("--compiled-attention/--no-compiled-attention",), bool, PANEL_MODEL),
    JobOption("model", "compiled_ops", ("--compiled-ops/--no-compiled-ops",), bool, PANEL_MODEL),
    JobOption("model", "batch_invariant", ("--batch-invariant/--no-batch-invariant",), bool, PANEL_MODEL),
    JobOption("model", "tp_size", ("--tp",), int, PANEL_MODEL, metavar="N"),
    JobOption("input", "format", ("--input-format",), str, PANEL_INPUT),
    JobOption("input", "same_input", ("--same-input/--not-same-input",), bool, PANEL_INPUT),
    JobOption("input", "split", ("--split",), str, PANEL_INPUT, metavar="NAME"),
    JobOption("input", "subset", ("--subset",), str, PANEL_INPUT, metavar="NAME"),
    JobOption("input", "prompt_column", ("--prompt-column",), str, PANEL_INPUT, metavar="NAME"),
    JobOption("input", "id_column", ("--id-column",), str, PANEL_INPUT, metavar="NAME"),
    JobOption("input", "keep_columns", ("--keep-columns",), list[str], PANEL_INPUT, metavar="A,B"),
    JobOption("input", "raw_prompts", ("--raw-prompts/--chat-prompts",), bool, PANEL_INPUT),
    JobOption("input", "max_line_bytes", ("--max-line-bytes",), int, PANEL_INPUT, metavar="BYTES"),
    JobOption("input", "template", ("--template",), str, PANEL_INPUT, metavar="TEXT|@FILE"),
    JobOption("input", "system", ("--system",), str, PANEL_INPUT, metavar="TEXT|@FILE"),
    JobOption("input", "max_render_chars", ("--max-render-chars",), int, PANEL_INPUT, metavar="CHARS"),
    JobOption("input", "render_timeout", ("--render-timeout",), float, PANEL_INPUT, metavar="SECONDS"),
    JobOption("generation", "max_new_tokens", ("--max-new-tokens",), int, PANEL_GENERATION),
    JobOption("generation", "do_sample", ("--do-sample/--greedy",), bool, PANEL_GENERATION),
    JobOption("generation", "temperature", ("--temperature", "-t"), float, PANEL_GENERATION),
    JobOption("generation", "top_p", ("--top-p",), float, PANEL_GENERATION),
    JobOption("generation", "top_k", ("--top-k",), int, PANEL_GENERATION),
    JobOption("generation", "seed", ("--seed",), int, PANEL_GENERATION),
    JobOption("generation", "num_return_sequences", ("--num-return-sequences", "-n"), int, PANEL_GENERATION),
    JobOption("generation", "logprobs", ("--logprobs/--no-logprobs",), bool, PANEL_GENERATION),
    JobOption("generation", "stop_token_ids", ("--stop-token-id",), list[int], PANEL_GENERATION, metavar="ID"),
    JobOption("generation", "stop", ("--stop",), list[str], PANEL_GENERATION, metavar="TEXT"),
    JobOption("generation", "top_logprobs", ("--top-logprobs",), int, PANEL_GENERATION, metavar="K"),
    JobOption("generation", "repetition_penalty", ("--repetition-penalty",), float, PANEL_GENERATION, metavar="X"),
    JobOption("generation", "presence_penalty", ("--presence-penalty",), float, PANEL_GENERATION, metavar="X"),
    JobOption("generation", "frequency_penalty", ("--frequency-penalty",), float, PANEL_GENERATION, metavar="X"),
    JobOption("generation", "no_repeat_ngram_size", ("--no-repeat-ngram-size",), int, PANEL_GENERATION, metavar="N"),
    JobOption("generation", "min_p", ("--min-p",), float, PANEL_GENERATION, metavar="P"),
    JobOption("generation", "min_tokens", ("--min-tokens",), int, PANEL_GENERATION, metavar="N"),
    JobOption("generation", "logit_bias", ("--logit-bias",), str, PANEL_GENERATION, metavar="JSON"),
    JobOption("generation", "ignore_eos", ("--ignore-eos/--no-ignore-eos",), bool, PANEL_GENERATION),
    JobOption("generation", "bad_words", ("--bad-word",), list[str], PANEL_GENERATION, metavar="TEXT"),
    JobOption("generation", "loop_stop", ("--loop-stop",), int, PANEL_GENERATION, metavar="K"),
    JobOption("generation", "loop_stop_span", ("--loop-stop-span",), int, PANEL_GENERATION, metavar="TOKENS"),
    JobOption("generation", "chat_template_kwargs", ("--chat-template-kwargs",), str, PANEL_GENERATION,
              metavar="JSON"),
    JobOption("generation", "response_template", ("--response-template",), str, PANEL_GENERATION,
              metavar="FILE|think"),
    JobOption("generation", "json_schema", ("--json-schema",), str, PANEL_STRUCTURED, metavar="FILE|JSON"),
    JobOption("generation", "json_object", ("--json-object/--no-json-object",), bool, PANEL_STRUCTURED),
    JobOption("generation", "regex", ("--regex",), str, PANEL_STRUCTURED, metavar="PATTERN"),
    JobOption("generation", "choice", ("--choice",), list[str], PANEL_STRUCTURED, metavar="TEXT"),
    JobOption("generation", "grammar", ("--grammar",), str, PANEL_STRUCTURED, metavar="FILE"),
    JobOption("batching", "page_size", ("--page-size",), int, PANEL_BATCHING),
    JobOption("batching", "max_batch_tokens", ("--max-batch-tokens",), int, PANEL_BATCHING),
    JobOption("batching", "max_requests_per_batch", ("--max-requests-per-batch",), int, PANEL_BATCHING),
    JobOption("batching", "num_blocks", ("--num-blocks",), int, PANEL_BATCHING),
    JobOption("batching", "max_memory_percent", ("--max-memory-percent",), float, PANEL_BATCHING),
    JobOption("batching", "scheduler_type", ("--scheduler",), str, PANEL_BATCHING, choices=("fifo", "prefill-first")),
    JobOption("batching", "safety_margin", ("--safety-margin",), float, PANEL_BATCHING),
    JobOption("batching", "use_cuda_graph", ("--use-cuda-graph/--no-cuda-graph",), bool, PANEL_BATCHING),
    JobOption("batching", "default_compile_level", ("--compile-level",), int, PANEL_BATCHING),
    JobOption("batching", "cpu_offload_space", ("--cpu-offload-space",), float, PANEL_BATCHING),
    JobOption("output", "dir", ("--output-dir", "-o"), str, PANEL_OUTPUT, metavar="DIR"),
    JobOption("output", "format", ("--output-format",), str, PANEL_OUTPUT),
    JobOption("output", "rows_per_shard", ("--rows-per-shard",), int, PANEL_OUTPUT),
    JobOption("output", "overwrite", ("--overwrite/--no-overwrite",), bool, PANEL_OUTPUT),
    JobOption("run", "max_in_flight", ("--max-in-flight",), int, PANEL_RUN),
    JobOption("run", "quiet", ("--quiet/--no-quiet", "-q"), bool, PANEL_RUN),
    JobOption("run", "request_timeout", ("--request-timeout",), float, PANEL_RUN, metavar="SECONDS"),
    JobOption("run", "max_errors", ("--max-errors",), int, PANEL_RUN),
    JobOption("run", "commit_interval", ("--commit-interval",), float, PANEL_RUN, metavar="SECONDS"),
    JobOption("run", "num_shards", ("--num-shards",), int, PANEL_RUN),
    JobOption("run", "executor", ("--executor",), str, PANEL_RUN),
    JobOption("run", "data_parallel", ("--data-parallel",), int, PANEL_RUN, metavar="N"),
    JobOption("run", "ray_num_cpus", ("--ray-num-cpus",), float, PANEL_RUN, metavar="N"),
    JobOption("run", "ray_num_gpus", ("--ray-num-gpus",), float, PANEL_RUN, metavar="N"),
    JobOption("run", "prefix_gating", ("--prefix-gating/--no-prefix-gating",), bool, PANEL_RUN),
    JobOption("run", "redo", ("--redo",), list[str], PANEL_RUN, metavar="failed,length"),
    JobOption("run", "result_cache", ("--result-cache/--no-cache",), bool, PANEL_RUN),
    JobOption("run", "cache", ("--cache",), str, PANEL_RUN, metavar="DIR"),
    JobOption("run", "cache_max_size", ("--cache-max-size",), float, PANEL_RUN, metavar="GB"),
    JobOption("run", "cache_near_hits", ("--cache-near-hits/--exact-hits-only",), bool, PANEL_RUN),
    JobOption("run", "shard_index", ("--shard-index",), int, PANEL_RUN),
]


def _parameter(option: JobOption) -> inspect.Parameter:
    kwargs: dict[str, Any] = {"help": option.help, "rich_help_panel": option.panel, "show_default": False}
    if option.metavar:
        kwargs["metavar"] = option.metavar
    value_type = Literal[option.values] if option.values else option.type
    # a type built at run time, for typer to read: the type checker cannot follow it
    annotation = Annotated[Optional[value_type], typer.Option(*option.flags, **kwargs)]  # type: ignore[valid-type]  # noqa: UP045, E501
    return inspect.Parameter(option.param_name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


SCORE_PANEL = "Scoring"
# `cbgen score`: the job options that apply to scoring (no sampling, no output formats, no engine), and its own
_SCORING_SECTIONS = {"model", "input", "output"}
_SCORING_KEYS = {("generation", "logprobs"), ("generation", "top_logprobs"), ("generation", "chat_template_kwargs"),
                 ("run", "quiet"), ("run", "max_errors"), ("run", "commit_interval"), ("run", "num_shards"),
                 ("run", "shard_index"), ("run", "redo"), ("run", "result_cache"), ("run", "cache"),
                 ("run", "cache_max_size"), ("run", "cache_near_hits")}
SCORE_OPTIONS: list[JobOption] = [
    *(o for o in JOB_OPTIONS if (o.section in _SCORING_SECTIONS or (o.section, o.key) in _SCORING_KEYS)
      and (o.section, o.key) != ("model", "tp_size")),
    JobOption("score", "choices", ("--choices",), list[str], SCORE_PANEL, metavar="A,B"),
    JobOption("score", "completion_column", ("--completion-column",), str, SCORE_PANEL, metavar="NAME"),
    JobOption("score", "text_column", ("--text-column",), str, SCORE_PANEL, metavar="NAME"),
    JobOption("score", "batch_tokens", ("--score-batch-tokens",), int, SCORE_PANEL, metavar="N"),
]


EMBED_PANEL = "Embedding"
_ENCODING_KEYS = {("model", "model"), ("model", "dtype"), ("model", "device"), ("model", "trust_remote_code"),
                  ("run", "quiet"), ("run", "max_errors"), ("run", "commit_interval"), ("run", "num_shards"),
                  ("run", "shard_index"), ("run", "redo")}
# `cbgen embed`: the job options that apply to an encoding model (no sampling, no engine, no chat template), and
# its own
EMBED_OPTIONS: list[JobOption] = [
    *(o for o in SCORE_OPTIONS if (o.section, o.key) in _ENCODING_KEYS or o.section in ("input", "output")
      and o.key not in ("prompt_column", "raw_prompts", "system")),
    JobOption("embed", "text_column", ("--text-column",), str, EMBED_PANEL, metavar="NAME"),
    JobOption("embed", "pooling", ("--pooling",), str, EMBED_PANEL),
    JobOption("embed", "normalize", ("--normalize/--no-normalize",), bool, EMBED_PANEL),
    JobOption("embed", "max_length", ("--max-length",), int, EMBED_PANEL, metavar="N"),
    JobOption("embed", "batch_tokens", ("--embed-batch-tokens",), int, EMBED_PANEL, metavar="N"),
    JobOption("embed", "packed", ("--packed/--padded",), bool, EMBED_PANEL),
]


def _normalise(option: JobOption, value: Any) -> Any:
    if option.key == "choices":  # comma-separated or repeated; spaces are part of the text scored: kept
        return [choice for item in value for choice in item.split(",") if choice]
    if option.key in ("keep_columns", "redo"):  # comma-separated, or repeated
        return [name.strip() for item in value for name in item.split(",") if name.strip()]
    return value


def with_options(options: list[JobOption]):
    """A decorator that adds `options` to a command's signature; the command gets the given ones as
    `overrides`."""

    def decorate(command):
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "overrides"]

        @functools.wraps(command)
        def wrapper(**kwargs):
            overrides = {}
            for option in options:
                value = kwargs.pop(option.param_name, None)
                if value is not None and value != []:
                    flag = option.flags[0].split("/")[0]
                    overrides[(option.section, option.key)] = (_normalise(option, value), flag)
            return command(overrides=overrides, **kwargs)

        wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # typer reads the signature
            own + [_parameter(o) for o in options])
        return wrapper

    return decorate


job_options = with_options(JOB_OPTIONS)  # cbgen run, cbgen config show
score_options = with_options(SCORE_OPTIONS)  # cbgen score
embed_options = with_options(EMBED_OPTIONS)  # cbgen embed


InputPath = Annotated[
    Optional[str],  # noqa: UP045 (typer)
    typer.Argument(metavar="INPUT", help=help_of("input", "path"), show_default=False),
]
ConfigFile = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--config", "-c", help="YAML job file (sections model, input, generation, batching, output, run); "
                 "flags override it. Start from `cbgen config init`.", metavar="FILE"),
]
