"""Compiling structured-output formats into token-level grammars, with llguidance.

llguidance was chosen by measuring it beside xgrammar on a 2-core AMD EPYC with the embedded tokenizer (README,
"Structured outputs"): a new schema compiles in milliseconds, so rows with a hundred distinct schemas cost nothing
noticeable, and a mask for 64 sequences fills in about a millisecond. Each format compiles once per job; matchers
(one per sequence) are cheap.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from cbgen.control.formats import FormatError, ResponseFormat

# Compact JSON: one fixed form of whitespace. With flexible whitespace a model that hesitates can wander through
# whitespace for many steps (measured with random logits: mask fills of seconds), and compact records are what a
# synthetic-data job wants anyway.
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """The grammars of one job's formats for one tokenizer: each compiled (and checked) once."""

    def __init__(self, tokenizer: Any, vocab_size: int, response_template: dict | None = None) -> None:
        import llguidance.hf

        self.tokenizer_info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)  # about 1 s, once
        self.eos_token_id = tokenizer.eos_token_id
        self._grammars: dict[str, str] = {}
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # total, for run.json
        self.compiled = 0
        self.response_template = response_template  # the model's, for required tool calls (cbgen.chat.responses)

    def check(self, fmt: ResponseFormat) -> str | None:
        """Why `fmt` cannot be used, or None."""
        try:
            self.grammar(fmt)
        except FormatError as e:
            return str(e)
        return None

    def grammar(self, fmt: ResponseFormat) -> str:
        """llguidance's grammar for `fmt`, compiled and validated the first time it is asked for."""
        with self._lock:
            known = self._grammars.get(fmt.key)
        if known is not None:
            return known
        import time

        from llguidance import LLMatcher

        started = time.perf_counter()
        grammar = _to_grammar(fmt, self.response_template)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer_info)
        if error:
            first = error.strip().splitlines()[0] if error.strip() else "invalid"
            raise FormatError(f"{fmt.describe()} cannot be compiled: {first}")
        with self._lock:
            self._grammars[fmt.key] = grammar
            self.compile_seconds += time.perf_counter() - started
            self.compiled += 1
        return grammar

    def accepts(self, fmt: ResponseFormat, text: str) -> bool:
        """Whether `text` is a complete output of `fmt` (the grammar works on bytes: any tokenization will do)."""
        matcher = self.matcher(fmt)
        tokens = self.tokenizer_info.tokenize_str(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    def matcher(self, fmt: ResponseFormat):
        """A fresh matcher for one sequence."""
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer_info, self.grammar(fmt), log_level=0)


def check_format(fmt: ResponseFormat) -> None:
    """Compiles `fmt` without a tokenizer (before any model loads); raises FormatError if it cannot be."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(_to_grammar(fmt))
    if error:
        first = error.strip().splitlines()[0] if error.strip() else "invalid"
        raise FormatError(f"{fmt.describe()} cannot be compiled: {first}")


def _to_grammar(fmt: ResponseFormat, response_template: dict | None = None) -> str:
    from llguidance import LLMatcher, gbnf_to_lark

    try:
        if fmt.kind == "tool_call":
            from cbgen.chat.tools import tool_call_grammar

            if response_template is None:
                raise ValueError("the model has no response template to say how it writes tool calls")
            spec = json.loads(fmt.spec)
            return LLMatcher.grammar_from_lark(tool_call_grammar(response_template, spec["tools"], spec["name"]))
        if fmt.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if fmt.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(fmt.spec, defaults=JSON_OPTIONS)
        if fmt.kind == "regex":
            return LLMatcher.grammar_from_regex(fmt.spec)
        if fmt.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(fmt.spec)))
        text = gbnf_to_lark(fmt.spec) if "::=" in fmt.spec else fmt.spec
        return LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError, RecursionError) as e:
        raise FormatError(f"{fmt.describe()} cannot be compiled: {e}") from None
