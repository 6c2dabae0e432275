"""OpenAI Batch API lines, both ways: request lines read from an input file, output lines written (and read back by
resume, `cbgen status` and `cbgen merge`). The wire shape lives here and nowhere else.

A request line is `{"custom_id", "method": "POST", "url", "body"}`. An output line is `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`: a success has status 200 and a `chat.completion` or
`text_completion` body; a failed request has 400 (its input was bad) or 500 (generation failed) and an OpenAI error
object as its body, as lines of OpenAI's error file do. The `openai` package's own types parse the bodies (tested).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from cbgen.errors import RowError, describe_type

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


def stable_hex(*parts: str, size: int = 12) -> str:
    """Stable ids: the same request gets the same ids in a rerun, so outputs compare byte for byte."""
    return hashlib.blake2b("\x1f".join(parts).encode("utf-8"), digest_size=size).hexdigest()


@dataclass(frozen=True)
class RequestLine:
    """One line of a batch input file."""

    custom_id: Any  # as written: the reader checks it like any id
    url: str
    body: dict[str, Any]
    method: str = "POST"
    extra: tuple[str, ...] = ()  # keys a request line does not have

    KEYS = ("custom_id", "method", "url", "body")

    @staticmethod
    def matches(row: Any) -> bool:
        """Whether a parsed JSON value looks like a batch request line."""
        return isinstance(row, dict) and "custom_id" in row and "body" in row

    @classmethod
    def parse(cls, row: dict[str, Any]) -> RequestLine:
        """The line, checked; RowError names the first key that is missing or wrong."""
        missing = [key for key in cls.KEYS if key not in row]
        if missing:
            raise RowError(f"the line has no {missing[0]!r}: an OpenAI batch request line needs "
                           f"{', '.join(cls.KEYS)}")
        method = row.get("method")
        if method != "POST":
            raise RowError(f"'method' must be POST, got {method!r}")
        url = row.get("url")
        if url not in ENDPOINTS:
            raise RowError(f"'url' must be {CHAT} or {COMPLETIONS} (the endpoints cbgen serves), got {url!r}")
        body = row.get("body")
        if not isinstance(body, dict):
            raise RowError(f"'body' must be an object, got {describe_type(body)}")
        extra = tuple(sorted(set(row) - set(cls.KEYS)))
        return cls(row.get("custom_id"), url, body, method, extra)

    @property
    def chat(self) -> bool:
        return self.url == CHAT


@dataclass
class Choice:
    """One returned sequence of a request."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None  # when the request asked for them
    tokens: list[str] | None = None  # the text of each token, beside logprobs
    top: list[list[tuple[str, float]]] | None = None  # per token, the most likely tokens (text, logprob)
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's {"id", "type": "function", "function"}, when parsed
    reasoning: str | None = None  # a reasoning model's thinking, apart from the content

    def chat(self, index: int) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            tops = self.top or [[] for _ in self.logprobs]
            logprobs = {"content": [{"token": token, "logprob": value, "bytes": list(token.encode("utf-8")),
                                     "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                                      for t, v in top]}
                                    for token, value, top in zip(self.tokens or [], self.logprobs, tops)],
                        "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
        finish_reason = self.finish_reason
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def completion(self, index: int) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            tokens = list(self.tokens or [])
            offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
            top = [{t: v for t, v in position} for position in self.top] if self.top is not None else None
            logprobs = {"tokens": tokens, "token_logprobs": list(self.logprobs), "top_logprobs": top,
                        "text_offset": offsets}
        return {"index": index, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason}


@dataclass
class OutputLine:
    """One line of a batch output file: the answer to one request line."""

    custom_id: str
    status_code: int
    body: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def matches(row: dict[str, Any]) -> bool:
        return "custom_id" in row and "response" in row

    @classmethod
    def success(cls, custom_id: str, endpoint: str | None, choices: list[Choice], *, model: str,
                prompt_tokens: int, created: int | None = None) -> OutputLine:
        chat = endpoint != COMPLETIONS
        completion_tokens = sum(len(c.token_ids) for c in choices)
        body = {
            "id": ("chatcmpl-" if chat else "cmpl-") + stable_hex(custom_id),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()) if created is None else created,
            "model": model,
            "choices": [c.chat(i) if chat else c.completion(i) for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": None,
        }
        return cls(custom_id, 200, body)

    @classmethod
    def failure(cls, custom_id: str, message: str, *, input_error: bool) -> OutputLine:
        """400 when the request itself was bad, 500 when generating it failed."""
        status, kind = (400, "invalid_request_error") if input_error else (500, "server_error")
        return cls(custom_id, status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

    @classmethod
    def from_dict(cls, line: dict[str, Any]) -> OutputLine:
        response = line.get("response") or {}
        body = response.get("body") or {}
        if response.get("status_code") != 200 and "error" not in body and line.get("error"):
            body = {"error": line["error"]}  # OpenAI's error files carry it on the line
        return cls(line["custom_id"], response.get("status_code", 500), body)

    def to_dict(self) -> dict[str, Any]:
        return {"id": f"batch_req_{stable_hex(self.custom_id, size=16)}", "custom_id": self.custom_id,
                "response": {"status_code": self.status_code, "request_id": stable_hex(self.custom_id, "request"),
                             "body": self.body},
                "error": None}

    def rows(self) -> list[dict[str, Any]]:
        """The cbgen rows (id, sample_index, text, finish_reason, token counts, error) this line stands for, so
        resume, `cbgen status` and `cbgen merge` treat both output shapes alike. A failed request is one error row."""
        if self.status_code != 200:
            message = (self.body.get("error") or {}).get("message") or "failed"
            return [{"id": self.custom_id, "sample_index": 0, "text": None, "finish_reason": "error",
                     "num_prompt_tokens": 0, "num_generated_tokens": 0, "error": message}]
        usage = self.body.get("usage") or {}
        rows = []
        for i, choice in enumerate(self.body.get("choices") or []):
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
            rows.append({
                "id": self.custom_id,
                "sample_index": choice.get("index", i),
                "text": text,
                "finish_reason": choice.get("finish_reason"),
                "num_prompt_tokens": usage.get("prompt_tokens", 0),
                # usage counts the request's tokens: on its first sequence, so sums over rows stay right
                "num_generated_tokens": usage.get("completion_tokens", 0) if i == 0 else 0,
                "error": None,
            })
        return rows
