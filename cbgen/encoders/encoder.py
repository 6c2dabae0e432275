"""Running an encoding model over a stream of requests: read ahead a window, sort it by length, cut it into batches
of at most `batch_tokens` tokens (padding included), one forward pass each, and yield each row's vector as it is
done. Sorting keeps the padding small: in a batch, every row is about as long as the longest.

An embedding model that fits runs its batches packed end to end, with no padding at all (cbgen.encoders.packed): a
batch is then cut by its token budget alone. An embed job pools each row's token vectors (cbgen.encoders.pooling); a
reward job takes the classifier's outputs,
as probabilities for a classifier. A decoder classifier finds a row's last token by the pad id, so rows whose own
tokens include the pad id (or a model with none) run alone, unpadded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from cbgen.encoders import packed
from cbgen.encoders.load import LoadedEncoder
from cbgen.encoders.pooling import pool
from cbgen.model import linear
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
    packed: bool = False
    packed_why: str = ""  # why batches are packed, or why they are padded
    linear: str = "stock"  # how its linear layers run (cbgen.model.linear.LINEAR_KINDS)

    def to_dict(self) -> dict[str, Any]:
        total = self.tokens + self.padded_tokens
        return {"forward_passes": self.forward_passes, "tokens": self.tokens, "padded_tokens": self.padded_tokens,
                "padding_share": round(self.padded_tokens / total, 4) if total else 0.0,
                "packed": {"on": self.packed, "why": self.packed_why}, "linear": self.linear}


class Encoder:
    def __init__(self, loaded: LoadedEncoder, batch_tokens: int, packed_batches: bool = True) -> None:
        self.loaded = loaded
        self.batch_tokens = batch_tokens
        self.stats = EncoderStats()
        config = loaded.model.config
        self.pad_id = (loaded.tokenizer.pad_token_id if loaded.pooling is not None else config.pad_token_id)
        self.device = next(loaded.model.parameters()).device
        why: str | None
        if loaded.pooling is None:
            why = "a classifier's batches are padded"
        elif not packed_batches:
            why = "padded batches asked for"
        else:
            why = packed.unfit_reason(loaded.model, self.device.type)
        self.stats.packed, self.stats.packed_why = why is None, why or "each text's own tokens, no padding"
        # float32 on CPU: the linear layers through oneDNN with prepacked weights, faster than torch's MKL matmul at
        # an embedding batch's rows (docs/performance.md, the constants); a vector's last bits may move
        dtype = next(loaded.model.parameters()).dtype
        if self.device.type == "cpu" and dtype == torch.float32 and linear.onednn_available():
            self.stats.linear = linear.LINEAR_KINDS[linear.ONEDNN]

    def run(self, requests: Iterable[Request], stop: threading.Event | None = None) -> Iterator[list[Completion]]:
        """Each request's completion, as a group of one, in the order they finish. A request with an error (or
        one answered already) is yielded as it is; once `stop` is set, no more batches start."""
        model = self.loaded.model
        onednn = self.stats.linear == linear.LINEAR_KINDS[linear.ONEDNN]
        with packed.packed_attention(model) if self.stats.packed else nullcontext(), \
                linear.linear_layers(model, linear.ONEDNN) if onednn else nullcontext():
            yield from self._run(iter(requests), stop)

    def _run(self, it: Iterator[Request], stop: threading.Event | None) -> Iterator[list[Completion]]:
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
        little padding (packed batches have none: their cut is the tokens alone)."""
        alone = [r for r in requests if not self._paddable(r)]
        yield from ([r] for r in alone)
        rows = sorted((r for r in requests if self._paddable(r)), key=lambda r: len(r.ids))
        batch: list[Request] = []
        tokens = 0
        for request in rows:  # ascending: the newest row is the longest
            n, length = len(batch) + 1, len(request.ids)
            padding = 1 - (tokens + length) / (n * length)
            size = tokens + length if self.stats.packed else n * length
            if batch and (size > self.batch_tokens or n > MAX_ROWS
                          or (padding > MAX_PADDING and n > FEW_ROWS and not self.stats.packed)):
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
        if self.stats.packed:
            return self._packed_forward(batch)
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
        return _completions(batch, vectors)

    def _packed_forward(self, batch: list[Request]) -> list[Completion]:
        pooling = self.loaded.pooling
        assert pooling is not None
        self.stats.forward_passes += 1
        self.stats.tokens += sum(len(r.ids) for r in batch)
        with torch.inference_mode():
            hidden, offsets = packed.forward(self.loaded.model, [r.ids for r in batch])
            vectors = packed.pool_packed(hidden, offsets, pooling.mode, pooling.normalize).float().cpu().tolist()
        return _completions(batch, vectors)


def _completions(batch: list[Request], vectors: list[list[float]]) -> list[Completion]:
    return [Completion(r, 0, r.ids, None, "length" if (r.uncut_length or 0) > len(r.ids) else "stop",
                       vector=vector) for r, vector in zip(batch, vectors)]


def _activated(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "softmax":
        return logits.softmax(-1)
    if activation == "sigmoid":
        return logits.sigmoid()
    return logits
