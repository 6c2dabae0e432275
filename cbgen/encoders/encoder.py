"""Running an encoding model over a stream of requests: read ahead a window, sort it by length, cut it into batches
of at most `batch_tokens` tokens (padding included), one forward pass each, and yield each row's vector as it is
done. Sorting keeps the padding small: in a batch, every row is about as long as the longest.

An embed job pools each row's token vectors (cbgen.encoders.pooling); a reward job takes the classifier's outputs,
as probabilities for a classifier. A decoder classifier finds a row's last token by the pad id, so rows whose own
tokens include the pad id (or a model with none) run alone, unpadded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from cbgen.encoders.load import LoadedEncoder
from cbgen.encoders.pooling import pool
from cbgen.records import Completion, Request

WINDOW = 2048  # requests read ahead and sorted by length
MAX_ROWS = 1024  # rows per batch, however short
# a batch takes the next (longer) row while its padding stays under this share, or while it has fewer rows than
# FEW_ROWS (a pass over a handful of rows wastes more than their padding)
MAX_PADDING, FEW_ROWS = 0.08, 8


@dataclass
class EncoderStats:
    forward_passes: int = 0
    tokens: int = 0
    padded_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        total = self.tokens + self.padded_tokens
        return {"forward_passes": self.forward_passes, "tokens": self.tokens, "padded_tokens": self.padded_tokens,
                "padding_share": round(self.padded_tokens / total, 4) if total else 0.0}


class Encoder:
    def __init__(self, loaded: LoadedEncoder, batch_tokens: int) -> None:
        self.loaded = loaded
        self.batch_tokens = batch_tokens
        self.stats = EncoderStats()
        config = loaded.model.config
        self.pad_id = (loaded.tokenizer.pad_token_id if loaded.pooling is not None else config.pad_token_id)
        self.device = next(loaded.model.parameters()).device

    def run(self, requests: Iterable[Request], stop: threading.Event | None = None) -> Iterator[list[Completion]]:
        """Each request's completion, as a group of one, in the order they finish. A request with an error (or
        one answered already) is yielded as it is; once `stop` is set, no more batches start."""
        it = iter(requests)
        while window := list(islice(it, WINDOW)):
            ready = []
            for request in window:
                if request.answered is not None:
                    yield request.answered
                elif request.error is not None or request.input_ids is None:
                    yield [Completion(request, 0, [], None, "error", request.error or "not rendered",
                                      rejected=True)]
                else:
                    ready.append(request)
            for batch in self.batches(ready):
                if stop is not None and stop.is_set():
                    return
                yield from ([c] for c in self._forward(batch))

    def batches(self, requests: list[Request]) -> Iterator[list[Request]]:
        """The requests sorted by length, cut into batches of at most batch_tokens tokens (a longer row alone) with
        little padding."""
        alone = [r for r in requests if not self._paddable(r)]
        yield from ([r] for r in alone)
        rows = sorted((r for r in requests if self._paddable(r)), key=lambda r: len(r.ids))
        batch: list[Request] = []
        tokens = 0
        for request in rows:  # ascending: the newest row is the longest
            n, length = len(batch) + 1, len(request.ids)
            padding = 1 - (tokens + length) / (n * length)
            if batch and (n * length > self.batch_tokens or n > MAX_ROWS
                          or (padding > MAX_PADDING and n > FEW_ROWS)):
                yield batch
                batch, tokens = [], 0
            batch.append(request)
            tokens += length
        if batch:
            yield batch

    def _paddable(self, request: Request) -> bool:
        """Whether the row may share a padded batch: always for an encoder or an embedding; for a decoder
        classifier, where the pad id marks the end of its own tokens only."""
        if self.loaded.pooling is not None or not self.loaded.decoder:
            return True
        return self.pad_id is not None and self.pad_id not in request.ids

    def _forward(self, batch: list[Request]) -> list[Completion]:
        loaded = self.loaded
        lengths = [len(r.ids) for r in batch]
        longest = max(lengths)
        ids = torch.full((len(batch), longest), self.pad_id if self.pad_id is not None else 0, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, request in enumerate(batch):
            ids[i, : lengths[i]] = torch.tensor(request.ids)
            mask[i, : lengths[i]] = 1
        self.stats.forward_passes += 1
        self.stats.tokens += sum(lengths)
        self.stats.padded_tokens += len(batch) * longest - sum(lengths)
        with torch.inference_mode():
            out = loaded.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            if loaded.pooling is not None:
                values = pool(out[0], mask.to(self.device), loaded.pooling.mode, loaded.pooling.normalize)
            else:
                values = _activated(out.logits.float(), loaded.activation)
            vectors = values.float().cpu().tolist()
        return [Completion(r, 0, r.ids, None, "length" if (r.uncut_length or 0) > len(r.ids) else "stop",
                           vector=vector) for r, vector in zip(batch, vectors)]


def _activated(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "softmax":
        return logits.softmax(-1)
    if activation == "sigmoid":
        return logits.sigmoid()
    return logits
