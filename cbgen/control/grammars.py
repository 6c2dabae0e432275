"""Compiling structured-output formats into token-level grammars, with llguidance.

llguidance was chosen by measuring it beside xgrammar on a 2-core AMD EPYC with the embedded tokenizer
(docs/performance.md, "Structured outputs"): a new schema compiles in milliseconds, so rows with a hundred distinct
schemas cost nothing noticeable, and a mask for 64 sequences fills in about a millisecond. Each format compiles once
per job; matchers (one per sequence) are cheap.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from cbgen.chat.formats import FormatError, ResponseFormat, grammar_text
from cbgen.errors import first_line

if TYPE_CHECKING:
    from cbgen.chat.responses import ResponseTemplate


class Grammars:
    """The grammars of one job's formats for one tokenizer: each compiled (and checked) once."""

    def __init__(self, tokenizer: Any, vocab_size: int, response_template: ResponseTemplate | None = None) -> None:
        import llguidance.hf

        self.tokenizer_info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)  # once per tokenizer
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
        grammar = grammar_text(fmt, self.response_template.spec if self.response_template else None)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer_info)
        if error:
            raise FormatError(f"{fmt.describe()} cannot be compiled: {first_line(error) or 'invalid'}")
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
