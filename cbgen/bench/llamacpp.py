"""The `llamacpp` path of `cbgen bench`: the workload's own prompt token ids through llama.cpp (its C library, driven
by llama-cpp-python's ctypes bindings), greedy, each request stopping at its cap or an end-of-sequence token, with
the model load excluded from the clock: the same rules as the other paths, so that the ratio is like for like.

llama.cpp's library has no scheduler of its own (its server has one), so this path keeps up to `parallel` sequences
in flight, as llama-server does: every step decodes one token for each running sequence and fills the rest of the
step's `n_batch` tokens with the prompts of waiting requests; a finished sequence frees its slot for the next one.

`benchmarks/build_llamacpp.sh` builds the library for this CPU and converts the embedded model to f32 and bf16 GGUF
files (the weights cbgen runs, dequantised from its Q4_1 file); without them the path is skipped, with the reason.

`LLAMA_ARG_REPACK=0` (llama.cpp's own variable for its tools' `--no-repack`) loads the weights without llama.cpp's
extra buffer types (repacked layouts, its AMX kernels): on a 2-core Sapphire Rapids VM, llama.cpp's AMX kernel for
Q8_0 stopped on an illegal instruction (`tilezero`), in llama-batched-bench as here.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from cbgen.errors import first_line

BUILD_HINT = "bash benchmarks/build_llamacpp.sh builds it"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
QUANTIZED = "q8_0"  # the `llamacpp-q8_0` path: the quantization a llama.cpp user would run on a CPU


def llamacpp_dir() -> Path:
    """Where benchmarks/build_llamacpp.sh puts its build and GGUF files: $CBGEN_LLAMACPP_DIR, else `llamacpp` in
    cbgen's cache directory ($CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen, else ~/.cache/cbgen)."""
    if os.environ.get("CBGEN_LLAMACPP_DIR"):
        return Path(os.environ["CBGEN_LLAMACPP_DIR"]).expanduser()
    from cbgen.cache_root import default_cache_dir

    return default_cache_dir() / "llamacpp"


def find_gguf(explicit: str | None, embedded: bool, dtype: str) -> tuple[Path | None, str | None]:
    """(the GGUF file llama.cpp should run, None) or (None, why the path is skipped). Without --llamacpp-model, the
    embedded model's conversion in cbgen's dtype (f32 for float32, bf16 for bfloat16), so both run the same weights
    in the same precision; `dtype` QUANTIZED: its Q8_0 conversion."""
    flag = "--llamacpp-q8-model" if dtype == QUANTIZED else "--llamacpp-model"
    if explicit:
        path = Path(explicit).expanduser()
        return (path, None) if path.is_file() else (None, f"{flag}: no file '{path}'")
    if not embedded:
        return None, f"give the GGUF file of this model with {flag}"
    kind = QUANTIZED if dtype == QUANTIZED else GGUF_TYPES.get(dtype)
    path = llamacpp_dir() / "models" / f"SmolLM2-135M-Instruct-{kind}.gguf"
    if kind is None or not path.is_file():
        return None, f"no {dtype} GGUF of the embedded model at '{path}' ({BUILD_HINT})"
    return path, None


def bindings() -> tuple[object | None, str | None]:
    """(llama-cpp-python's low-level module, None) or (None, why it cannot be used)."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp logs every load step otherwise
    try:
        import llama_cpp
    except ImportError as e:
        return None, f"llama.cpp's Python bindings do not load ({e}); {BUILD_HINT}"
    except (OSError, RuntimeError) as e:  # the package without its shared library
        return None, f"llama.cpp's library does not load ({first_line(e)}); {BUILD_HINT}"
    return llama_cpp, None


@dataclass
class _Sequence:
    index: int  # the request's place in the workload
    prompt: list[int]
    cap: int
    fed: int = 0  # prompt tokens already decoded
    tokens: list[int] = field(default_factory=list)


@dataclass
class Run:
    seconds: float
    tokens: list[list[int]]  # each request's generated tokens, in workload order


class LlamaCpp:
    """One llama.cpp model and context, sized for `parallel` sequences of up to `max_len` tokens each."""

    def __init__(self, lib, gguf: Path, threads: int, parallel: int, max_len: int, n_batch: int = 2048,
                 n_ubatch: int = 512, repack: bool | None = None) -> None:
        """`repack`: load the weights into llama.cpp's repacked layouts (its extra buffer types; None: unless
        LLAMA_ARG_REPACK says no)."""
        self.lib, self.parallel, self.n_batch = lib, parallel, n_batch
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        if repack is None:
            repack = os.environ.get("LLAMA_ARG_REPACK", "").lower() not in ("0", "false", "off", "no")
        if not repack:
            model_params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load '{gguf}'")
        params = lib.llama_context_default_params()
        params.n_ctx = parallel * max_len  # each sequence gets its own n_ctx / n_seq_max cells, as batched-bench
        params.n_batch, params.n_ubatch, params.n_seq_max = n_batch, n_ubatch, parallel
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot make a context of this size")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _greedy(self, row: int) -> int:
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def run(self, prompts: list[list[int]], caps: list[int], eos: frozenset[int]) -> Run:
        lib, batch = self.lib, self.batch
        lib.llama_memory_clear(self.memory, True)
        waiting = deque(_Sequence(i, p, c) for i, (p, c) in enumerate(zip(prompts, caps)))
        free = list(range(self.parallel - 1, -1, -1))
        running: dict[int, _Sequence] = {}  # slot -> sequence
        done: list[list[int]] = [[] for _ in prompts]
        start = time.perf_counter()
        while waiting or running:
            while waiting and free:
                running[free.pop()] = waiting.popleft()
            entries: list[tuple[int, int, int, bool]] = []  # (token, position, slot, wants logits)
            for slot, seq in running.items():  # one token for each decoding sequence first
                if seq.fed == len(seq.prompt):
                    entries.append((seq.tokens[-1], len(seq.prompt) + len(seq.tokens) - 1, slot, True))
            for slot, seq in running.items():  # then prompt chunks, as far as the step's tokens allow
                while seq.fed < len(seq.prompt) and len(entries) < self.n_batch:
                    seq.fed += 1
                    entries.append((seq.prompt[seq.fed - 1], seq.fed - 1, slot, seq.fed == len(seq.prompt)))
            outputs = []  # (batch row, slot) of each sequence whose next token this step gives
            for n, (token, pos, slot, logits) in enumerate(entries):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = slot, logits
                if logits:
                    outputs.append((n, slot))
            n = len(entries)
            batch.n_tokens = n
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (the context is too small for this workload)")
            for row, slot in outputs:
                seq = running[slot]
                token = self._greedy(row)
                seq.tokens.append(token)
                if token in eos or len(seq.tokens) >= seq.cap:
                    done[seq.index] = seq.tokens
                    lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
                    del running[slot]
                    free.append(slot)
        return Run(time.perf_counter() - start, done)


_PROBE = """
import sys
from pathlib import Path
from cbgen.bench.llamacpp import LlamaCpp, bindings
lib, _ = bindings()
engine = LlamaCpp(lib, Path(sys.argv[1]), 2, 2, 256, repack=True)
engine.run([[1, 2, 3, 4, 5] * 8, [6, 7, 8] * 8], [4, 4], frozenset())
engine.close()
"""


def repack_works(gguf: Path) -> tuple[bool, str]:
    """Whether llama.cpp runs `gguf` with its repacked weight layouts on this machine, tried in a child process
    (on a 2-core Sapphire Rapids VM its repacked Q8_0 kernels stopped the process: SIGILL on one machine, SIGSEGV on
    another), and what was seen."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "llama.cpp with repacked weights did not finish two short requests in 120 s"
    if done.returncode == 0:
        return True, "repacked weights (llama.cpp's default)"
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
    return False, f"repacked weights off: llama.cpp with them stopped on {how} here (LLAMA_ARG_REPACK=0's layout)"
