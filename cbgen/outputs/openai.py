"""OpenAI Batch API output lines: one per request, shaped as OpenAI's batch output (and error) files have them.

A success is `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion or
text_completion>}, "error": null}`; a failed request carries status 400 (its input was bad) or 500 (generation
failed) and an OpenAI error object as its body, as lines of OpenAI's error file do. The `openai` package's own
types (`ChatCompletion`, `Completion`) parse the bodies; the tests check that.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _hex(*parts: str, size: int = 12) -> str:
    """Stable ids: the same request gets the same ids in a rerun, so outputs compare byte for byte."""
    return hashlib.blake2b("\x1f".join(parts).encode("utf-8"), digest_size=size).hexdigest()


def batch_line(
    custom_id: str,
    endpoint: str | None,
    choices: Sequence[dict[str, Any]],
    *,
    model: str,
    prompt_tokens: int,
    error: str | None = None,
    input_error: bool = False,
    created: int | None = None,
) -> dict[str, Any]:
    """One output line. `choices` holds, per returned sequence: text, token_ids, finish_reason and, when the request
    asked for them, `logprobs` (list of floats) with `tokens` (the text of each token)."""
    request_id = _hex(custom_id, "request")
    line: dict[str, Any] = {"id": f"batch_req_{_hex(custom_id, size=16)}", "custom_id": custom_id}
    if error is not None:
        status, kind = (400, "invalid_request_error") if input_error else (500, "server_error")
        body = {"error": {"message": error, "type": kind, "param": None, "code": None}}
        line["response"] = {"status_code": status, "request_id": request_id, "body": body}
        line["error"] = None
        return line
    created = int(time.time()) if created is None else created
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    chat = endpoint != COMPLETIONS
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + _hex(custom_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(i, c) if chat else _text_choice(i, c) for i, c in enumerate(choices)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    line["error"] = None
    return line


def _chat_choice(index: int, choice: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if choice.get("logprobs") is not None:
        logprobs = {
            "content": [
                {"token": token, "logprob": value, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, value in zip(choice["tokens"], choice["logprobs"])
            ],
            "refusal": None,
        }
    return {
        "index": index,
        "message": {"role": "assistant", "content": choice["text"], "refusal": None},
        "logprobs": logprobs,
        "finish_reason": choice["finish_reason"],
    }


def _text_choice(index: int, choice: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if choice.get("logprobs") is not None:
        offsets, position = [], 0
        for token in choice["tokens"]:
            offsets.append(position)
            position += len(token)
        logprobs = {"tokens": list(choice["tokens"]), "token_logprobs": list(choice["logprobs"]),
                    "top_logprobs": None, "text_offset": offsets}
    return {"index": index, "text": choice["text"], "logprobs": logprobs, "finish_reason": choice["finish_reason"]}


def is_batch_line(row: dict[str, Any]) -> bool:
    return "custom_id" in row and "response" in row


def rows_of_line(line: dict[str, Any]) -> list[dict[str, Any]]:
    """The cbgen rows (id, sample_index, text, finish_reason, token counts, error) an output line stands for, so
    resume, `cbgen status` and `cbgen merge` treat both output shapes alike. A failed request is one error row."""
    response = line.get("response") or {}
    body = response.get("body") or {}
    if response.get("status_code") != 200:
        message = (body.get("error") or {}).get("message") or (line.get("error") or {}).get("message")
        return [{"id": line["custom_id"], "sample_index": 0, "text": None, "finish_reason": "error",
                 "num_prompt_tokens": 0, "num_generated_tokens": 0, "error": message or "failed"}]
    usage = body.get("usage") or {}
    rows = []
    for i, choice in enumerate(body.get("choices") or []):
        text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
        rows.append({
            "id": line["custom_id"],
            "sample_index": choice.get("index", i),
            "text": text,
            "finish_reason": choice.get("finish_reason"),
            "num_prompt_tokens": usage.get("prompt_tokens", 0),
            # usage counts the request's tokens: on its first sequence, so sums over rows stay right
            "num_generated_tokens": usage.get("completion_tokens", 0) if i == 0 else 0,
            "error": None,
        })
    return rows
