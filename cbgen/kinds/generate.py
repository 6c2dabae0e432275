"""The generate kind (`cbgen run`, `kind: generate`): each input row's prompt answered by the model, one or several
sampled sequences per row."""

from __future__ import annotations

from typing import Any

from cbgen.kinds.base import Kind
from cbgen.progress import plural
from cbgen.records import BASE_FIELDS, RESERVED_NAMES

REPLY_FIELDS = ("reasoning", "tool_calls")


class Generate(Kind):
    name = "generate"
    command = "cbgen run"
    adapters = "rows"
    several_samples = True
    card_title = "Generations by cbgen"
    card_verb = "answered"

    def column_names(self, columns: Any) -> tuple[str, ...]:
        return (*BASE_FIELDS, *(("logprobs",) if columns.logprobs else ()),
                *(("top_logprobs",) if columns.top_logprobs else ()), *(REPLY_FIELDS if columns.replies else ()),
                *(("parsed",) if columns.parsed else ()), *columns.kept)

    def reserved_names(self) -> frozenset[str]:
        return RESERVED_NAMES

    def identifies(self, columns: set[str] | frozenset[str]) -> bool:
        return "num_generated_tokens" in columns

    def counts(self, summary: Any) -> dict[str, int]:
        return {"requests": summary.requests, "failed_requests": summary.failed_requests,
                "sequences": summary.sequences, "succeeded": summary.succeeded, "failed": summary.failed,
                "prompt_tokens": summary.prompt_tokens, "generated_tokens": summary.generated_tokens,
                "resumed_requests": summary.resumed_requests, "loop_stopped": summary.loop_stopped,
                "loop_tokens_saved": summary.loop_tokens_saved}

    def summary_rows(self, summary: Any, duration: Any, cache_line: Any) -> list[tuple[str, str]]:
        throughput = summary.throughput()
        kv = summary.kv_cache
        rows = [
            ("model", str(summary.model)),
            ("requests", f"{summary.requests} ({plural(summary.sequences, 'sequence')})"),
            ("succeeded / failed", f"{summary.succeeded} / {summary.failed}"),
            ("prompt / generated tokens", f"{summary.prompt_tokens:,} / {summary.generated_tokens:,}"),
            ("generated tokens/s", f"{throughput['generated_tokens_per_s']:,.1f}"),
            ("prompt + generated tokens/s", f"{throughput['total_tokens_per_s']:,.1f}"),
            self.timings_row(summary, duration, "generation"),
        ]
        if summary.loop_stopped:
            rows.append(("ended by the loop stop", f"{plural(summary.loop_stopped, 'sequence')}, "
                                                   f"{summary.loop_tokens_saved:,} tokens not spent on loops"))
        formats = summary.step_control.get("formats_compiled")
        if formats:
            rows.append(("output formats", f"{plural(formats, 'grammar')} compiled in "
                                           f"{summary.step_control['compile_s']:.2f} s"))
        rows.append(("KV cache", f"{kv.get('num_blocks')} blocks of {kv.get('page_size')} tokens "
                                 f"({kv.get('chosen_by')})" if kv.get("num_blocks") is not None
                     else "none: the engine did not start (no request left to compute)"))
        return [*rows, ("result cache", cache_line(summary.result_cache)), self.output_row(summary)]

    @property
    def summary_title(self) -> str:
        return "cbgen run summary"
