"""What decides an answer, as a key: a sequence's (or a score's) inputs hashed with the model's weights, and the
numerics it was computed with kept beside it.

A generated sequence is decided by the weights (their digest), the dtype, the exact prompt token ids, the settings
that change its tokens (its end-of-sequence ids and stop strings, its output format's grammar, its sampling
parameters and, when it is sampled, its seed and sample index) and by the bits of the arithmetic. The first group
makes the key. The arithmetic is recorded in the entry (`Numerics`): an entry is an exact answer for a run only where
both computed with the same numerics and those are batch-invariant, since only then would a fresh run give the same
bits. The token cap (`max_new_tokens`) and the logprob settings are left out of the key: an answer that ended on
its own below a cap is the answer under any larger cap, one cut by its cap is the answer to a smaller one cut
shorter, and an entry that holds logprobs serves a request that wants fewer (cbgen.result_cache.cache decides).

An unseeded sampled sequence has no key at all: its draws are random, and a cached one would not be its answer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cbgen.engine.scope import ScopePlan
    from cbgen.model.load import LoadedModel
    from cbgen.records import Request

KEY_VERSION = 2  # raised whenever what a key holds, or what an entry means, changes


def digest(value: Any) -> str:
    """SHA-256 of a value's canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Numerics:
    """The arithmetic an answer was computed with: equal numerics on both sides, batch-invariant, make an exact hit."""

    batch_invariant: bool
    attention: str
    linear: str
    device: str
    tp: int  # tensor-parallel processes: the model's sums split over them
    machine: str  # the CPU kind and torch's CPU capability (or the GPU): other kernels, other bits
    torch: str
    transformers: str
    cbgen: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, loaded: LoadedModel, scope: ScopePlan, tp: int = 1) -> Numerics:
        import torch
        import transformers

        from cbgen import __version__
        from cbgen.config.cpu import cpu_model, cpu_row

        if loaded.device == "cpu":  # one CPU model's kernels: another's (even of one kind) may sum differently
            machine = f"{cpu_model()}: {cpu_row().kind}, torch {torch.backends.cpu.get_cpu_capability()}"
        else:
            machine = torch.cuda.get_device_name() if torch.cuda.is_available() else loaded.device
        return cls(scope.batch_invariant, scope.attention, scope.linear, loaded.device, tp, machine, torch.__version__,
                   transformers.__version__, __version__)


def weights_identity(loaded: LoadedModel, memo: Path) -> dict[str, Any] | None:
    """What names the model's weights, by content: the digest of the GGUF file or of a folder's weight files (each
    hashed once and remembered by size and modification time in `memo`), or a random-weight shape (seeded, so the
    same weights); with "int8" where they run as 8 bits (cbgen.model.int8), "w8a8" where their input rows do too;
    None when they cannot be told (a hub id whose files are not on disk)."""
    named = _weights(loaded, memo)
    if named is None or loaded.quantized is None:
        return named
    return named | {"quantized": "w8a8" if loaded.quantized.get("arithmetic") == "w8a8" else "int8"}


def _weights(loaded: LoadedModel, memo: Path) -> dict[str, Any] | None:
    from cbgen.files import file_digest
    from cbgen.model.source import weight_files

    source = loaded.source
    if source.random_weights:
        return source.identity()
    if source.gguf_file:
        return {"gguf": file_digest(source.gguf_path, memo)}
    folder = Path(source.location)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source.location, local_files_only=True))
        except Exception:  # noqa: BLE001 - not on disk (or not a hub id): the weights cannot be named
            return None
    files = weight_files(folder)
    if not files:
        return None
    return {"files": {path.name: file_digest(path, memo) for path in files}}


class Keyer:
    """The keys of one job's answers: `model` names the weights (weights_identity), `job` holds the settings that are
    the same for every request (dtype, end-of-sequence ids, the job's sampling)."""

    def __init__(self, model: dict[str, Any], dtype: str, eos: list[int], sampling: dict[str, Any],
                 do_sample: bool, adapters: dict[str | None, dict[str, Any]] | None = None) -> None:
        self.base = {"v": KEY_VERSION, "model": model, "dtype": dtype}
        self.eos = sorted(eos)
        self.sampling = sampling
        self.do_sample = do_sample
        # the LoRA adapters merged into the weights: the identity (by content) of each name a request may give, None
        # for the job's own; a request without one has no "adapter" field in its key (as before adapters existed)
        self.adapters = adapters or {}

    def _adapter(self, name: str | None) -> dict[str, Any]:
        identity = self.adapters.get(name)
        return {"adapter": identity} if identity is not None else {}

    def sequence_keys(self, request: Request, n: int) -> list[str] | None:
        """The key of each of the request's `n` sequences, or None when they cannot be cached (unseeded sampling)."""
        from cbgen.control.processor import GRAMMAR_KWARG, SEED_KWARG

        own = dict(request.sampling)
        seed = own.pop(SEED_KWARG, None)
        own.pop(GRAMMAR_KWARG, None)
        if self.do_sample and seed is None:
            return None
        fields = {**self.base, **self._adapter(request.adapter), "kind": "generate", "prompt": request.ids,
                  "eos": self.eos, "stop": list(request.stop),
                  "format": request.response_format.key if request.response_format is not None else None,
                  "sampling": {**self.sampling, **own}, "seed": seed if self.do_sample else None}
        if not self.do_sample:
            return [digest(fields | {"sample": 0})] * n
        return [digest(fields | {"sample": k}) for k in range(n)]

    def score_key(self, context: list[int], continuations: list[list[int]], text: bool) -> str:
        """The key of a scoring row: its context and what is scored after it (or the text itself)."""
        return digest({**self.base, **self._adapter(None), "kind": "score", "context": context,
                       "continuations": continuations, "text": text})
